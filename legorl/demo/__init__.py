"""The CPU learning demo's library side: a family of tiny procedurally generated repair tasks
(:mod:`.taskgen`) and the supervised warm-up on the driver's conversation format (:mod:`.sft`)."""

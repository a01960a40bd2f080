"""What the grading container runs (Python 3.8+, standard library only): copied in as the package
``legorl_grading`` (:data:`legorl.grading.script.PACKAGE`) and started as files with ``python3 -I``;
the host imports them only to test them. :mod:`.judge` (with :mod:`.screen`), :mod:`.canary` (with
:mod:`.expectations`) and :mod:`.runner` (with :mod:`.guard`)."""

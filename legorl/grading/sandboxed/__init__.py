"""What the grading container runs (Python 3.8+, standard library only): copied in as the package
``legorl_grading`` (:data:`legorl.grading.script.PACKAGE`) and started with ``python3 -I`` by
:func:`legorl.grading.script.launch`; the host imports them only to test them. :mod:`.judge` (with
:mod:`.screen`), :mod:`.canary` (with :mod:`.expectations`) and :mod:`.runner` (with :mod:`.guard`)."""

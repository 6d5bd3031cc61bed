"""The entry layer's planning: the only package that imports every layer.

In: a step function, its example arguments and a ``ParallelConfig``. Out: a ``Compiled`` step
(``api``: trace, search, lower, pick the runner). Beside it: ``hybrid_plan`` (hybrid_parallel:
the user's own collectives, traced per device), ``pipeline_plan`` (cutting a step into pipeline
stages and lowering each on its stage mesh) and ``dump`` (the strategy's collective records).
"""

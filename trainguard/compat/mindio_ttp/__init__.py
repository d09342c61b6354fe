"""MindIO TTP / TFT (``mindio_ttp``) names, run on trainguard.

``mindio_ttp.framework_ttp`` -> :mod:`trainguard.compat.mindio_ttp.framework_ttp`
(controller, processor, update window, handler registration, the
``@ttp_to_persist`` wrapper) and ``mindio_ttp.megatron_ttp`` ->
:mod:`trainguard.compat.mindio_ttp.megatron_ttp` (Megatron's checkpoint
handlers, ``load_checkpoint``, ``ReplicatedOptimizer``).
"""

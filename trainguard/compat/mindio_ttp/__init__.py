"""MindIO TTP / TFT (``mindio_ttp``) names, run on trainguard.

``mindio_ttp.framework_ttp`` -> :mod:`trainguard.compat.mindio_ttp.framework_ttp`
(controller, processor, update window, handler registration, the
``@ttp_to_persist`` wrapper) and ``mindio_ttp.megatron_ttp`` ->
:mod:`trainguard.compat.mindio_ttp.megatron_ttp` (Megatron's checkpoint
handlers, ``load_checkpoint``, ``ReplicatedOptimizer``). Both hold only
the drop-in names: each is a thin call into the Megatron adapter
(:mod:`trainguard.adapters.megatron.runtime`, ``.saves``, ``.recovery``),
where the TTP session (:mod:`trainguard.adapters.megatron.session`,
re-exported as :mod:`.state`) lives.
"""

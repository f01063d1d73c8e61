"""Hugging Face checkpoints in and out: our models in the ``transformers`` layout.

* :func:`load_hf_config` maps a ``config.json`` onto our model config. Options we do not implement
  (another architecture, a rope type other than default/linear/llama3/yarn (:mod:`levanter.models.rope`),
  biases where the family has none...) are refused, naming the ``config.json`` field, rather than loaded
  into a model that would compute something else.
* :func:`load_hf_checkpoint` reads the weights (``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` names) into our model, in float32.
* :func:`save_hf_checkpoint` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained``
  loads, all or nothing.
* :func:`merge_hf_model_config` and :class:`HfExporter` are what ``train_lm`` uses for
  ``initialize_from_hf`` and ``hf_save_path``.

This package is split by concept; this module is only the facade that re-exports the ``__all__`` of the
modules below (not of the family modules: each names its layout ``LAYOUT`` and its mappings ``from_hf``/
``to_hf``, reached through the family registry):

* :mod:`.hub` -- where a checkpoint is (local directory, object-store URL, hub id; fast failure offline);
* :mod:`.safetensors_io` -- the safetensors format and a checkpoint's whole state dict;
* :mod:`.families` -- the registry of model families (config mapping both ways, weight layouts), with
  one module per family (:mod:`.gpt2`, :mod:`.llama`, :mod:`.qwen`, :mod:`.mistral`, :mod:`.mixtral`,
  :mod:`.gemma`, :mod:`.olmo`); its docstring says how to add one;
* :mod:`.weights` -- our parameters <-> Hugging Face tensors through a family's layout;
* :mod:`.load` -- reading a checkpoint into our model and merging its shape into a run's config;
* :mod:`.export` -- writing a checkpoint directory, and the exporter used during training;
* :mod:`.peft` -- a LoRA run's adapters as a PEFT checkpoint (``adapter_model.safetensors``,
  ``adapter_config.json``).
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("hub", "safetensors_io", "families", "weights", "load", "export", "peft")
)

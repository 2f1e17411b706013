"""transformers' ``Trainer`` on an adopted accelerator (``adopt.py``): what its FSDP branches
need from the plugin.

With an FSDP plugin in its accelerator's state (an adopted accelerator has one on every
device), the ``Trainer`` takes its FSDP paths, which work on the plugin's models as they
are (``DTensor`` ``Shard(0)`` parameters, FSDP2's layout) except in these places:

* its checkpoints go through Accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` /
  ``load_fsdp_model`` / ``load_fsdp_optimizer`` (``torch.distributed.checkpoint``), whose
  state-dict helpers look every parameter up with ``getattr``: on a plugin model that is
  the gathering property, one all-gather of the whole parameter per lookup, several per
  save. The helpers, as ``transformers.trainer`` holds them, run with the gathers off
  (``gather_disabled``): they read the shards, as Accelerate's ``save_state`` does here.
* its step checkpoints (``checkpoint-N/``) are written in place, and
  ``resume_from_checkpoint=True`` picks the newest folder whatever it holds: a run killed
  while writing one leaves a DCP folder without its ``.metadata`` or a rank's shard (the
  load then fails deep in torch's reader) or, killed later, no ``trainer_state.json``
  (transformers stops with ``FileNotFoundError`` before anything is loaded). Before the
  ``Trainer`` loads a plugin model from a folder, the folder is checked: an incomplete one
  is an ``IncompleteCheckpointError`` on every rank naming what it lacks and the newest
  complete checkpoint beside it (``shard/atomic_checkpoint.py``).
* ``Trainer.save_model(out)`` writes the model only when the FSDP state-dict type is
  ``FULL_STATE_DICT``; with ``SHARDED_STATE_DICT`` (``configs/overlap.yaml``) it writes
  nothing, without a word (transformers' FSDP recipe is to call
  ``trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")`` first).
  For a plugin model, a ``save_model`` the user calls does that for the call: the folder
  holds full weights that plain ``from_pretrained`` loads (through
  ``accelerator.get_state_dict``, the plugin's ``full_state_dict``). The ``Trainer``'s own
  checkpoints (``save_model(..., _internal_call=True)``) keep the sharded files.

* under tensor parallelism (``parallelism_config_tp_size``, ``mesh.tensor``) the two ranks of
  a tensor-parallel pair train on the same batches, and the ``Trainer`` divides its token
  count (``num_items_in_batch``, the denominator of a causal LM's loss) by ``get_tp_size()``
  whether or not it summed the count over the ranks first. With
  ``average_tokens_across_devices=True`` (the default) it did, each pair's batch counted once
  per rank, and the division is right (the loss is then multiplied by ``num_processes //
  get_tp_size()``, the data-parallel size the gradient reduce-scatter averages over). With
  ``average_tokens_across_devices=False`` the count is this rank's own batch, counted once:
  divided by the tensor size, every loss and gradient came out ``tp_size`` times too large,
  silently (transformers 5.24, ``Trainer._get_num_items_in_batch``). For a plugin model the
  count is taken without that division in that case (``get_tp_size`` reads 1 during the
  count; a transformers that stops dividing there is unaffected): each data-parallel rank's
  loss is its batch's mean, as without tensor parallelism.

``install()`` wraps them once, when an accelerator is adopted in a process that has
imported ``transformers.trainer``; models that are not the plugin's are untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ..core import check_complete, gather_disabled
from .adopt import is_plugin_model

__all__ = ["install"]

_WRAPPED = "_fsdp_overlap_wrapped"
_STATE_DICT_ATTRS = ("state_dict_type", "state_dict_config", "optim_state_dict_config")
_CHECKPOINT_HELPERS = ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer")
#: What the Trainer writes last into a step checkpoint (rank 0, after every rank's files).
TRAINER_STATE = "trainer_state.json"


def install() -> None:
    """Wrap what ``transformers.trainer`` uses (see the module doc); a no-op when it is not
    imported, or already wrapped."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return
    for name in _CHECKPOINT_HELPERS:
        helper = getattr(module, name, None)
        if helper is not None and not getattr(helper, _WRAPPED, False):
            setattr(module, name, _reading_shards(helper))
    trainer = getattr(module, "Trainer", None)
    if trainer is not None and not getattr(trainer.save_model, _WRAPPED, False):
        trainer.save_model = _full_save_model(trainer.save_model)
    count = getattr(trainer, "_get_num_items_in_batch", None)
    if count is not None and not getattr(count, _WRAPPED, False):
        trainer._get_num_items_in_batch = _counting_each_pair_once(count)


def _reading_shards(helper: Any) -> Any:
    """``helper(fsdp_plugin, accelerator, [optimizer,] model, ...)`` with the gathers off
    when ``model`` is the plugin's; before ``load_fsdp_model``, the folder checked."""

    loads_model = helper.__name__ == "load_fsdp_model"  # (fsdp_plugin, accelerator, model, input_dir, ...)

    @functools.wraps(helper)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not any(is_plugin_model(a) for a in (*args, *kwargs.values())):
            return helper(*args, **kwargs)
        if loads_model:  # the first thing a resume loads: a checkpoint-N folder
            check_complete(kwargs["input_dir"] if "input_dir" in kwargs else args[3], required=(TRAINER_STATE,))
        with gather_disabled():
            return helper(*args, **kwargs)

    setattr(wrapped, _WRAPPED, True)
    return wrapped


def _full_save_model(save_model: Any) -> Any:
    @functools.wraps(save_model)
    def wrapped(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        plugin = getattr(getattr(self, "accelerator", None), "state", None)
        plugin = getattr(plugin, "fsdp_plugin", None)
        if _internal_call or plugin is None or not is_plugin_model(self.model):
            return save_model(self, output_dir, _internal_call=_internal_call)
        if "FULL_STATE_DICT" in str(plugin.state_dict_type):
            return save_model(self, output_dir, _internal_call=_internal_call)
        # set_state_dict_type fills the configs only where they are None: keep all three
        saved = {name: getattr(plugin, name) for name in _STATE_DICT_ATTRS}
        for name in _STATE_DICT_ATTRS[1:]:
            setattr(plugin, name, None)
        plugin.set_state_dict_type("FULL_STATE_DICT")
        try:
            return save_model(self, output_dir, _internal_call=_internal_call)
        finally:
            for name, value in saved.items():
                setattr(plugin, name, value)

    setattr(wrapped, _WRAPPED, True)
    return wrapped


def _counting_each_pair_once(count: Any) -> Any:
    """``Trainer._get_num_items_in_batch(batch_samples, device)`` without the division by the
    tensor-parallel size when the count was not summed over the ranks
    (``average_tokens_across_devices=False``): see the module doc."""

    @functools.wraps(count)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.args, "average_tokens_across_devices", True) or not is_plugin_model(self.model):
            return count(self, *args, **kwargs)
        if self.get_tp_size() <= 1:
            return count(self, *args, **kwargs)
        # an instance attribute shadows the method (a subclass's override too) for this call
        shadowed = vars(self).get("get_tp_size", _ABSENT)
        self.get_tp_size = lambda: 1
        try:
            return count(self, *args, **kwargs)
        finally:
            if shadowed is _ABSENT:
                del self.get_tp_size
            else:
                self.get_tp_size = shadowed

    setattr(wrapped, _WRAPPED, True)
    return wrapped


_ABSENT = object()

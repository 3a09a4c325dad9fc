"""The model's task head on tree rows: a language model, per-token values, or per-sequence scores.

HF puts one of several heads on a decoder, and on tree rows each reads differently
(:func:`task_head` names it from the model's class):

- ``lm``: a causal LM (``*ForCausalLM``, ``*ForConditionalGeneration``, ``*LMHeadModel``) or a
  bare base model: ``[K, L, vocab]`` logits or ``[K, L, d]`` hidden states per row position,
  read back with :meth:`~treepack.trainer.data.packed_batch.PackedBatch.unpack_logprobs`;
- ``token``: ``*ForTokenClassification`` (the usual PPO value head, ``num_labels=1``): HF's
  logits are per position, ``[K, L, num_labels]``, each sequence's read back with
  :meth:`~treepack.trainer.data.packed_batch.PackedBatch.unpack_values`;
- ``sequence``: ``*ForSequenceClassification`` (reward models): HF scores every position and
  pools each *row* at its last non-pad token, one score per row, which on tree rows is
  another sequence's. :func:`sequence_scores` takes the per-position output of the head's
  score module (``score`` or ``classifier``) and reads each sequence at its own pooled token,
  HF's rule applied to the sequence alone (its last token that is not ``pad_token_id``; its
  last token when no pad id is set): ``[S_local, num_labels]``, one row per sequence of
  ``batch.local_seqs``.

Any other head (question answering, multiple choice, masked LM, pre-training, ...) is refused
by name before any compute (:func:`head_refusals`, part of the admission's static check), and
so is a sequence head whose forward does not pool at the last non-pad token.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.wrapped import forward_logits, transient_hook

__all__ = ["TaskHead", "HEAD_KINDS", "task_head", "head_refusals", "pad_rule", "sequence_scores"]

HEAD_KINDS = ("lm", "token", "sequence")

_LM_NAME = re.compile(r"(ForCausalLM|ForConditionalGeneration|LMHeadModel|WithLMHead)$")
_SCORE_MODULES = ("score", "classifier")
# HF's sequence classification pools each row at its last non-pad token (GenericForSequenceClassification
# and the families that copy it): the rule treepack applies per sequence.
_POOLS_LAST_NON_PAD = re.compile(r"last_non_pad_token")
# A pad id no token has: HF's pooling runs on rows (ignored) without refusing a batch of several rows.
_NO_TOKEN = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskHead:
    """What a model's head gives per row position and how it is read back per sequence.

    Attributes:
        kind: ``lm`` | ``token`` | ``sequence`` (module docstring).
        cls: the HF class that decided it (the model's own, or the transformers class it subclasses).
        score_path: ``sequence``: the module whose per-position output HF pools (``score`` or
            ``classifier``); None otherwise.
        pad_token_id: ``sequence``: the pad id of HF's rule (None: the last token).
    """

    kind: str
    cls: str
    score_path: str | None = None
    pad_token_id: int | None = None


def _hf_class(hf: Any) -> type:
    """The first class of ``hf``'s MRO defined by transformers (its own class for a stock model)."""
    return next((c for c in type(hf).__mro__ if c.__module__.startswith("transformers.")), type(hf))


def _kind(cls: type) -> str | None:
    name = cls.__name__
    if name.endswith("ForSequenceClassification"):
        return "sequence"
    if name.endswith("ForTokenClassification"):
        return "token"
    if "For" in name and not _LM_NAME.search(name):
        return None
    return "lm"


def _pad_id(hf: Any) -> int | None:
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    pad = getattr(cfg, "pad_token_id", None)
    return None if pad is None else int(pad)


def task_head(hf: Any) -> TaskHead:
    """The :class:`TaskHead` of the unwrapped HF model ``hf``.

    Raises:
        UnsupportedModelError: a head that is neither a language model, a token head nor a
            sequence head (rule ``unsupported_head``).
    """
    cls = _hf_class(hf)
    kind = _kind(cls)
    if kind is None:
        raise UnsupportedModelError(
            _other_head(cls),
            path="$.model",
            rule="unsupported_head",
            refusals=(("", type(hf).__name__, _other_head(cls)),),
        )
    if kind != "sequence":
        return TaskHead(kind=kind, cls=cls.__name__)
    path = next((p for p in _SCORE_MODULES if isinstance(getattr(hf, p, None), torch.nn.Module)), None)
    return TaskHead(kind=kind, cls=cls.__name__, score_path=path, pad_token_id=_pad_id(hf))


def _other_head(cls: type) -> str:
    return (
        f"{cls.__name__} is not a head treepack runs on tree rows (causal LM, *ForTokenClassification values, "
        "*ForSequenceClassification scores)"
    )


def head_refusals(hf: Any, output: str, kwargs: dict[str, Any], cp_size: int = 0) -> list[tuple[str, str, str]]:
    """Why ``hf``'s head cannot give ``output`` exactly on tree rows: (path, class, reason) triples.

    Args:
        hf: the unwrapped HF model.
        output: the setup's output (``logits`` | ``hidden``).
        kwargs: the model-call keywords (``labels`` is refused for a classification head: HF's
            loss would read the rows, not the sequences).
        cp_size: context-parallel ranks of the batch (a classification head on CP shards is
            refused: its per-sequence reads over shards are not proven).
    """
    cls = _hf_class(hf)
    kind = _kind(cls)
    name = type(hf).__name__
    if kind is None:
        return [("", name, _other_head(cls))]
    if kind == "lm":
        return []
    out = []
    if output != "logits":
        out.append(("", name, f"a {kind}-classification head gives its outputs with output='logits', not {output!r}"))
    if "labels" in kwargs:
        out.append(("", name, "labels: HF's loss would read the rows; compute it from the unpacked outputs"))
    if cp_size:
        out.append(
            ("", name, f"a {kind}-classification head on context-parallel shards (not proven; run it with cp=None)")
        )
    if kind == "token":
        return out
    head = task_head(hf)
    if head.score_path is None:
        out.append(("", name, f"no score module ({' / '.join(_SCORE_MODULES)}) whose per-position output HF pools"))
    try:
        src = inspect.getsource(type(hf).forward)
    except (OSError, TypeError):
        src = ""
    if not _POOLS_LAST_NON_PAD.search(src):
        out.append(("", name, "its forward does not pool at the last non-pad token as HF's sequence heads do"))
    return out


@contextmanager
def pad_rule(hf: Any) -> Iterator[None]:
    """While inside: a sequence head with no pad id gets one no token has, so HF's own (ignored)
    pooling runs on a batch of several rows instead of refusing it; every other model as it is.

    HF's rule without a pad id is the sequence's last token, which is what a pad id no
    token has gives too: the model alone computes the same scores inside as outside.
    """
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    if _kind(_hf_class(hf)) != "sequence" or getattr(cfg, "pad_token_id", 0) is not None:
        yield
        return
    cfg.pad_token_id = _NO_TOKEN
    try:
        yield
    finally:
        cfg.pad_token_id = None


def per_position_scores(model: Any, hf: Any, head: TaskHead, inputs: dict[str, Any]) -> torch.Tensor:
    """[B, T, num_labels] output of the head's score module at every position of ``model(**inputs)``.

    Raises:
        UnsupportedModelError: the score module ran other than once on ``[B, T, ...]``.
    """
    assert head.score_path is not None, "head_refusals refuses a sequence head without a score module"
    mod = hf.get_submodule(head.score_path)
    seen: list[Any] = []
    with pad_rule(hf), transient_hook(mod, lambda m, a, out: seen.append(out)):
        forward_logits(model, inputs)
    ids = inputs["input_ids"]
    if len(seen) != 1 or not isinstance(seen[0], torch.Tensor) or tuple(seen[0].shape[:2]) != tuple(ids.shape):
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in seen]
        msg = f"{head.score_path} ({type(mod).__name__}) gave {got}, not one [rows, seq_len, labels] output"
        raise UnsupportedModelError(
            f"{type(hf).__name__}: {msg}",
            path=f"$.model.{head.score_path}",
            rule="unsupported_head",
            refusals=((head.score_path, type(mod).__name__, msg),),
        )
    return seen[0]


def sequence_scores(model: Any, hf: Any, head: TaskHead, inputs: dict[str, Any], batch: Any) -> torch.Tensor:
    """[S_local, num_labels] each sequence's score at its own pooled token, from one call of ``model`` on the rows.

    Args:
        model: the model as held (wrappers run). hf: its unwrapped HF model. head: ``hf``'s
            sequence :class:`TaskHead`. inputs: the packed call's keywords. batch: the packed batch.

    Returns:
        One row per sequence of ``batch.local_seqs``
        (:meth:`~treepack.trainer.data.packed_batch.PackedBatch.sequence_values`).
    """
    return batch.sequence_values(per_position_scores(model, hf, head, inputs), head.pad_token_id)

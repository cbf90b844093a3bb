"""Is the draft aligned with the target? Compare tokenizers, never embedding rows.

Speculation is only sound when a draft token id means the same token to the
target. Embedding matrices are often padded past the tokenizer's size (to a
multiple of 64 or 128), so row counts say nothing; the tokenizers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPECIAL_TOKENS = ("bos", "eos", "pad")


@dataclass(frozen=True)
class AlignmentReport:
    """The outcome of comparing the two tokenizers; each problem names its difference."""

    aligned: bool
    problems: list[str]
    target_vocab_size: int
    draft_vocab_size: int
    shared_vocab_size: int
    notes: list[str] = field(default_factory=list)

    @property
    def refusal_reason(self) -> str | None:
        """Why speculation is refused, or None when the pair is aligned."""
        if self.aligned:
            return None
        return "draft is not aligned with the target: " + "; ".join(self.problems)

    def to_dict(self) -> dict[str, object]:
        return {
            "aligned": self.aligned,
            "problems": list(self.problems),
            "notes": list(self.notes),
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "shared_vocab_size": self.shared_vocab_size,
        }


def id_to_token(tokenizer: Any) -> dict[int, str]:
    """Every id the tokenizer knows (added tokens included) and its token string."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    return {index: token for token, index in vocab.items()}


def vocab_size(tokenizer: Any) -> int:
    """One past the largest token id: the range of ids the tokenizer can emit."""
    ids = tokenizer.get_vocab().values()
    return max(ids) + 1 if ids else 0


def compare_vocab(target: dict[int, str], draft: dict[int, str], shared: int) -> str | None:
    """Ids below ``shared`` must map to the same token in both tokenizers."""
    differing = [i for i in range(shared) if target.get(i) != draft.get(i)]
    if not differing:
        return None
    first = differing[0]
    count = len(differing)
    noun = "token maps" if count == 1 else "tokens map"
    return (
        f"vocab: {count} {noun} to different ids, first: id {first} is "
        f"{target.get(first)!r} in the target and {draft.get(first)!r} in the draft"
    )


def special_token(tokenizer: Any, kind: str) -> tuple[str | None, int | None]:
    """(string, id) of the tokenizer's bos/eos/pad token; (None, None) when unset."""
    text: str | None = getattr(tokenizer, f"{kind}_token", None)
    index: int | None = getattr(tokenizer, f"{kind}_token_id", None)
    return (str(text) if text is not None else None, index)


def compare_special(target: Any, draft: Any, kind: str) -> str | None:
    t_text, t_id = special_token(target, kind)
    d_text, d_id = special_token(draft, kind)
    if (t_text, t_id) == (d_text, d_id):
        return None
    return (
        f"special token {kind}: target {_describe(t_text, t_id)} != draft {_describe(d_text, d_id)}"
    )


def _describe(text: str | None, index: int | None) -> str:
    return "unset" if text is None and index is None else f"{text!r} ({index})"


def compare_chat_template(target: Any, draft: Any) -> str | None:
    t_template = getattr(target, "chat_template", None)
    d_template = getattr(draft, "chat_template", None)
    if t_template == d_template:
        return None
    if t_template is None or d_template is None:
        which = "draft" if t_template is not None else "target"
        return f"chat template differs: the {which} has none"
    if isinstance(t_template, str) and isinstance(d_template, str):
        offset = next(
            (i for i, (a, b) in enumerate(zip(t_template, d_template, strict=False)) if a != b),
            min(len(t_template), len(d_template)),
        )
        return f"chat template differs (first difference at character {offset})"
    return "chat template differs"


def logits_width(model: Any) -> int:
    """How many logits the model emits per position (its possibly padded vocab size)."""
    return int(model.config.vocab_size)


def compare_model_width(model: Any, tokenizer_size: int, role: str) -> str | None:
    """Padding past the tokenizer is normal; fewer logits than ids is worth a note.

    Not a mismatch: ids the model cannot score are ids it can never emit (a GGUF
    tokenizer rebuilt by transformers may, e.g., gain an unused ``<|endoftext|>``).
    """
    width = logits_width(model)
    if width >= tokenizer_size:
        return None
    return f"{role} model scores {width} ids but its tokenizer has {tokenizer_size}"


def check_alignment(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    *,
    target_model: Any = None,
    draft_model: Any = None,
) -> AlignmentReport:
    """Compare vocab (over the shared id range), special tokens and chat template.

    With the models given, also note a model that scores fewer ids than its
    tokenizer has (embedding rows past the tokenizer are vocab padding: fine).
    """
    target_ids = id_to_token(target_tokenizer)
    draft_ids = id_to_token(draft_tokenizer)
    target_size = vocab_size(target_tokenizer)
    draft_size = vocab_size(draft_tokenizer)
    shared = min(target_size, draft_size)
    checks = [compare_vocab(target_ids, draft_ids, shared)]
    checks += [compare_special(target_tokenizer, draft_tokenizer, kind) for kind in SPECIAL_TOKENS]
    checks.append(compare_chat_template(target_tokenizer, draft_tokenizer))
    problems = [problem for problem in checks if problem is not None]
    notes = []
    for model, size, role in (
        (target_model, target_size, "target"),
        (draft_model, draft_size, "draft"),
    ):
        note = compare_model_width(model, size, role) if model is not None else None
        if note is not None:
            notes.append(note)
    if target_size != draft_size:
        # Tokens past the shared range: the draft may propose one the target cannot
        # emit, which the target then rejects (probability 0), so output stays exact.
        notes.append(
            f"vocab sizes differ (target {target_size}, draft {draft_size}); "
            f"only the shared range of {shared} ids is compared"
        )
    return AlignmentReport(
        aligned=not problems,
        problems=problems,
        target_vocab_size=target_size,
        draft_vocab_size=draft_size,
        shared_vocab_size=shared,
        notes=notes,
    )

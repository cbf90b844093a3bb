"""Golden-prompt files: schema and expectation checks.

A contract module (torch-free): the operator renders golden prompts into a
ConfigMap, the runtime decodes them and checks the outputs here. The file's
``nearTieMargin`` says how far speculative and target-only greedy output may
differ by floating-point numerics (see ``engine/golden_check.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from specpair_runtime.config import ConfigError, ContractModel, describe_validation_error


class Expectation(ContractModel):
    """What a golden output must satisfy. All given checks must hold."""

    contains: list[str] = Field(default_factory=list, description="Substrings that must appear.")
    not_contains: list[str] = Field(
        default_factory=list, description="Substrings that must not appear."
    )
    regex: str | None = Field(default=None, description="A regex that must match (search).")
    equals: str | None = Field(default=None, description="The exact expected text.")

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(f"not a valid regex: {error}") from None
        return value


class GoldenPrompt(ContractModel):
    name: str = Field(min_length=1, description="Name shown in reports.")
    prompt: str = Field(description="The prompt text.")
    chat: bool = Field(default=False, description="Apply the chat template as a user message.")
    max_new_tokens: int = Field(default=16, ge=1, le=512, description="Tokens to decode.")
    expect: Expectation = Field(default_factory=Expectation, description="Output checks.")


class GoldenFile(ContractModel):
    prompts: list[GoldenPrompt] = Field(min_length=1, description="The golden prompts.")
    near_tie_margin: float | None = Field(
        default=None,
        ge=0.0,
        description=(
            "Logits. Where speculative and target-only greedy output first differ, the "
            "difference passes only if the target's logits for the two tokens are within "
            "this margin of its top logit (a near-tie that floating-point numerics may "
            "flip). Unset: 0 on the CPU (exact identity), 0.5 on CUDA."
        ),
    )


def check_expectation(expectation: Expectation, text: str) -> list[str]:
    """Return the failed checks as readable strings; empty means pass."""
    failures = [f"output does not contain {s!r}" for s in expectation.contains if s not in text]
    failures += [f"output contains {s!r}" for s in expectation.not_contains if s in text]
    if expectation.regex is not None and re.search(expectation.regex, text) is None:
        failures.append(f"output does not match regex {expectation.regex!r}")
    if expectation.equals is not None and text != expectation.equals:
        failures.append(f"output {text!r} != expected {expectation.equals!r}")
    return failures


def parse_golden(data: object) -> GoldenFile:
    try:
        return GoldenFile.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def load_golden(path: Path) -> GoldenFile:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read golden file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_golden(data)

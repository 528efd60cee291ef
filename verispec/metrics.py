"""SpecStats: the one definition of acceptance rate, mean accepted length and per-position acceptance.

Definitions (DESIGN.md):
- acceptance rate = accepted draft tokens / drafted tokens;
- mean accepted length (tau) = tokens committed per target forward pass, *including* the recovered
  or bonus token, so plain decoding scores exactly 1.0 and a step that accepts all k drafts scores
  k + 1;
- per-position acceptance: of the steps that drafted a token at position i, the share in which it
  was accepted (acceptance at position i implies acceptance at every earlier position).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0
    """Target forward passes (verification steps; the prefill step included)."""
    num_committed: int = 0
    """Tokens committed by those steps (before truncation at EOS, a stop string or the length limit)."""
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    """drafted_at[i]: steps that proposed a draft token at position i."""
    accepted_at: list[int] = field(default_factory=list)
    """accepted_at[i]: steps whose draft token at position i was accepted."""
    num_output_tokens: int = 0
    """Tokens returned to the caller."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache instead of a prefill."""
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @classmethod
    def combined(cls, parts: list[SpecStats]) -> SpecStats:
        """The statistics of several sequences decoded side by side for one request (its choices):
        counts add up; the prompt is one prompt, and times are the longest, as the sequences shared
        their steps (so ``tokens_per_second`` is the request's throughput)."""
        width = max((len(p.drafted_at) for p in parts), default=0)

        def at(name: str) -> list[int]:
            return [
                sum(getattr(p, name)[i] for p in parts if i < len(getattr(p, name))) for i in range(width)
            ]

        out = cls(
            drafted_at=at("drafted_at"),
            accepted_at=at("accepted_at"),
            prompt_tokens=max((p.prompt_tokens for p in parts), default=0),
            cached_prompt_tokens=max((p.cached_prompt_tokens for p in parts), default=0),
        )
        for name in ("num_steps", "num_committed", "num_drafted", "num_accepted", "num_output_tokens"):
            setattr(out, name, sum(getattr(p, name) for p in parts))
        for name in ("draft_seconds", "verify_seconds", "total_seconds"):
            setattr(out, name, max((getattr(p, name) for p in parts), default=0.0))
        return out

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Record one verification step."""
        self.num_steps += 1
        self.num_committed += num_accepted + 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        missing = num_drafted - len(self.drafted_at)
        if missing > 0:
            self.drafted_at.extend([0] * missing)
            self.accepted_at.extend([0] * missing)
        for i in range(num_drafted):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_committed / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.total_seconds if self.total_seconds else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "output_tokens": self.num_output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "target_forward_passes": self.num_steps,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
            "seconds": {
                "total": self.total_seconds,
                "draft": self.draft_seconds,
                "verify": self.verify_seconds,
                "other": self.other_seconds,
            },
        }

    def summary(self) -> str:
        """One line for humans."""
        line = (
            f"{self.num_output_tokens} tokens in {self.total_seconds:.2f}s"
            f" ({self.tokens_per_second:.2f} tok/s)"
            f" | target passes {self.num_steps} | mean accepted length {self.mean_accepted_length:.2f}"
        )
        if self.num_drafted:
            line += f" | acceptance {self.acceptance_rate:.1%} ({self.num_accepted}/{self.num_drafted})"
        return line

"""What the adaptive strategy chooses between: an arm is plain decoding or (drafter, k), measured per batch bucket.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

ArmKey = tuple[int, str | None, int]  # (bucket, drafter, k)


@dataclass(frozen=True, slots=True)
class Arm:
    drafter: str | None  # None = plain decoding
    k: int = 0
    # (lookahead drafter, n): rows it has n or more drafts for take its drafts (see the module docstring). The same
    # arm as without: it costs the same step.
    assist: tuple[str, int] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        if self.drafter is None or self.k == 0:
            return "plain"
        return f"{self.drafter}:k={self.k}" + (f"+{self.assist[0]}" if self.assist else "")


PLAIN = Arm(None, 0)


def bucket_of(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


def arm_key(batch_size: int, s: Arm) -> ArmKey:
    return bucket_of(batch_size), s.drafter if s.k else None, s.k

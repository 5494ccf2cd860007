"""The bank used by the channel, taping and snapshot tests: tellers send each other money.

Each teller holds a balance (conserved across the bank: a cut that loses or duplicates a
message shows up as a wrong total), an order-sensitive float accumulator (a reordered
delivery shows up in its bits) and its own RNG (a wrong restore shows up in its stream).
"""

from __future__ import annotations

from typing import Any

import torch

INITIAL = 1000  # every teller's opening balance


class Teller:
    """A bank branch: its balance, an order-sensitive float accumulator, its own RNG."""

    def __init__(self, seed: int) -> None:
        self.balance = torch.tensor(INITIAL, dtype=torch.int64)
        self.acc = torch.zeros(3, dtype=torch.float64)
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"balance": self.balance, "acc": self.acc, "rng": self.gen.get_state(), "steps": self.steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.balance.copy_(sd["balance"])
        self.acc.copy_(sd["acc"])
        self.gen.set_state(sd["rng"])
        self.steps = int(sd["steps"])

    def step(self, ep: Any) -> None:
        # The receive comes first: a cut (which happens inside it) then falls exactly at
        # an iteration boundary, so the registered state is all a restore needs.
        m = ep.try_recv()
        if m is not None:
            self.balance += m.tensors[0]
            self.acc.mul_(0.5).add_(m.tensors[1])
        r = int(torch.randint(0, 1 << 30, (1,), generator=self.gen))
        outs = sorted(ep.outbound)
        if r % 3 != 0 and outs and int(self.balance) > 0:
            dst = outs[(r >> 2) % len(outs)]
            amt = 1 + (r >> 7) % int(self.balance)
            self.balance -= amt
            noise = torch.rand(3, generator=self.gen, dtype=torch.float64)
            ep.send(dst, {"amt": amt}, [torch.tensor(amt, dtype=torch.int64), noise])
        self.steps += 1

    def final(self, ep: Any) -> dict[str, Any]:
        """Everything a bit-exact comparison needs, as plain values."""
        return {"balance": int(self.balance), "acc": self.acc.numpy().tobytes(),
                "rng": self.gen.get_state().numpy().tobytes(), "steps": self.steps, "clock": ep.clock.encode(),
                "next_send": ep.next_send, "next_recv": ep.next_recv}


class Box:
    """The smallest registered state: a tensor and a counter."""

    def __init__(self, v: float) -> None:
        self.w = torch.full((4,), v)
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.w.copy_(sd["w"])
        self.n = int(sd["n"])


def finish_forced(names: list[str], tellers: dict[str, Teller], eps: dict[str, Any], targets: dict[str, int]) -> None:
    """Step every teller whose endpoint can deliver until each reached its target step (a
    forced replay: the delivery order is the tape's, so no one waits on timing)."""
    while True:
        todo = [a for a in names if tellers[a].steps < targets[a]]
        if not todo:
            return
        ready = [a for a in todo if eps[a].can_deliver()]
        assert ready, f"forced replay deadlocked with {todo} unfinished"
        for a in ready:
            tellers[a].step(eps[a])

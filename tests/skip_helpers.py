"""What the skipped-step tests share (train.nonfinite=skip, fp16's overflow skips): the hooks that
poison a rank's batch (a non-finite loss) or a gradient (an overflow), and the reference run that
never trained those steps."""
from __future__ import annotations

import dataclasses
import math

import torch

from helpers import make_cfg
from trainer.workload.data.synthetic import SyntheticData
from trainer.run.resolve.configure import load_config
from trainer.run.runner import RunResult, Trainer
from trainer.sparse.schedule.feed import Feed


# ---------------------------------------------------------------------------- a non-finite loss
def poison(steps: tuple[int, ...], rank: int) -> None:
    """From now on (this process), rank `rank`'s batch of each step in `steps` carries an infinite
    dense feature: through data.train_batch (no global view) and Feed.step (placement, Herald)."""
    real_batch, real_step = SyntheticData.train_batch, Feed.step

    def bad(batch, step: int, r: int):
        if step not in steps or r != rank:
            return batch
        dense = batch.dense.clone()
        dense[0, 0] = math.inf
        return dataclasses.replace(batch, dense=dense)

    SyntheticData.train_batch = lambda self, step: bad(real_batch(self, step), step, self.rank)

    def feed_step(self, step):
        batch, info = real_step(self, step)
        return bad(batch, step, self.rank), info

    Feed.step = feed_step


def reference(comm, overrides: list[str], skip: tuple[int, ...], t: Trainer | None = None) -> RunResult:
    """The same trainer, never calling train_step for the steps in `skip`; flushed, gathered."""
    t = t if t is not None else Trainer(load_config(make_cfg(overrides)), comm, None)
    losses = [t.train_step(s) for s in range(t.c.train.steps) if s not in skip]
    t.emb.flush()
    return RunResult({}, comm.rank, losses, t._gather_state())


def without(losses: list[float], skip: tuple[int, ...]) -> list[float]:
    assert all(not math.isfinite(losses[s]) for s in skip), losses
    return [v for s, v in enumerate(losses) if s not in skip]


def poison_w1(monkeypatch, steps):
    monkeypatch.setattr(SyntheticData, "train_batch", SyntheticData.train_batch)
    monkeypatch.setattr(Feed, "step", Feed.step)  # restored after the test
    poison(steps, 0)


# ---------------------------------------------------------------------------- fp16's loss scaler
FP16 = ["optim=adam", "train.precision=fp16", "train.loss_scale.init=1024"]


def inject(where: str, steps: tuple[int, ...], rank: int) -> None:
    """From now on (this process), rank `rank`'s backward of each step in `steps` puts an inf in
    one element of a gradient: the first dense parameter's (dense) or the pooled rows' (rows)."""
    real = Trainer.train_step

    def bomb(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[0] = math.inf
        return g

    def train_step(self: Trainer, step: int) -> float:
        if step not in steps or self.rank != rank:
            return real(self, step)
        handles, lookup = [], self.emb.lookup
        if where == "dense":
            handles.append(self.params[0].register_hook(bomb))
        else:
            def bombed(flight):
                out = lookup(flight)
                handles.append(out.register_hook(bomb))
                return out
            self.emb.lookup = bombed
        try:
            return real(self, step)
        finally:
            self.emb.lookup = lookup
            for h in handles:
                h.remove()

    Trainer.train_step = train_step

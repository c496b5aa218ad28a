"""Feedback-driven mixing through the loader: when updates take effect, what they are, exact resume."""

from __future__ import annotations

import functools
import json
import re
import warnings

import numpy as np
import pytest
import shardutil
import torch
from resume_oracle import assert_resumes_exactly, batch_view, take
from shardutil import RESUME_SOURCES

import mixer
from mixer import Adaptive
from mixer.errors import ConfigError, StateError
from mixer.mixing.adaptive import Exp3, ExpGradient


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(RESUME_SOURCES)


WEIGHTS = {"web": 0.5, "code": 0.3, "tiny": 0.2}
PRIOR = np.array([0.5, 0.3, 0.2])
mixture = functools.partial(
    shardutil.mixture, weights=WEIGHTS, batching=mixer.TokenBudget(max_tokens=2048), state_every=8, shuffle_buffer=64
)


def fake_loss(batch):
    """A per-sample loss that depends on the source and the length (float32, as a model's would be)."""
    return (batch.source.float() + 1) * 0.5 + batch.lengths.float() / 4096


class Trained:
    """A training loop as the resume oracle sees it: every batch handed out is reported back."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            self.loader.feedback(batch, fake_loss(batch))
            yield batch

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def run(loader, n):
    return [(b.meta.step, b.meta.target, b.source.clone(), fake_loss(b).double()) for b in take(Trained(loader), n)]


@pytest.mark.parametrize("num_workers,lag", [(0, None), (2, 7)])
def test_updates_take_effect_at_the_agreed_step_with_the_policy_s_shares(shards, num_workers, lag):
    U = 4
    mix = mixture(
        shards,
        schedule=Adaptive(mixer.Weights(WEIGHTS), policy="exp3", lr=0.05, update_every=U, smoothing=0.2, lag=lag),
    )
    loader = mixer.make_loader(mix, num_workers=num_workers)
    effective_lag = 1 if lag is None else lag  # no workers, no device feed, no sync: 0 + 0 + 0 + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(loader, 3 * U + effective_lag + 2)
    assert not [w for w in caught if "waited" in str(w.message)]  # no reader had to wait
    assert [s for s, *_ in got] == list(range(len(got)))
    # The policy fed with what the test itself reports, window by window.
    policy, rows = Exp3(3, lr=0.05, smoothing=0.2), []
    closed = (len(got) - 1) // U  # windows close when step (j + 1) · U is handed out
    for j in range(closed):
        sums, counts = np.zeros(3), np.zeros(3)
        for step, _, source, loss in got[j * U : (j + 1) * U]:
            np.add.at(sums, source.numpy(), loss.numpy())
            np.add.at(counts, source.numpy(), 1)
        # Importance weights: the shares in effect at the window's last step.
        in_effect = max(0, ((j + 1) * U - 1 - effective_lag) // U)
        rows.append(policy.update(sums, counts, PRIOR, PRIOR if in_effect == 0 else rows[in_effect - 1]))
    for step, target, *_ in got:
        k = max(0, (step - effective_lag) // U)  # updates in effect
        expected = PRIOR if k == 0 else rows[k - 1]
        np.testing.assert_allclose(target, expected, rtol=0, atol=1e-12, err_msg=f"step {step}")
    assert not np.allclose(rows[0], PRIOR)  # the test sees a change
    out = loader.stats()["adaptive"]
    assert out["updates"] == closed and out["lag"] == effective_lag
    assert out["target"] == dict(zip(WEIGHTS, rows[-1].tolist()))
    assert out["from_step"] == closed * U + effective_lag


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_across_update_boundaries(shards, num_workers):
    # update_every 5, lag 7 (>= 2·2 + 1 with workers): windows close at 5, 10, 15, 20; rows apply
    # from 12, 17, 22, 27. Cuts before, at and after boundaries and effect steps.
    schedule = Adaptive(mixer.Weights(WEIGHTS), policy="exp_gradient", lr=3.0, update_every=5, smoothing=0.1, lag=7)
    mix = mixture(shards, schedule=schedule)
    make = lambda: Trained(mixer.make_loader(mix, num_workers=num_workers))  # noqa: E731
    reference = assert_resumes_exactly(make, cuts=[4, 5, 6, 12, 16, 20], window=12, view=batch_view)
    # The shares did move (else this would test nothing beyond plain resume).
    targets = [b.meta.target for b in take(make(), 30)]
    assert targets[11] == targets[0] != targets[12]
    assert len(reference) == 32


def test_state_carries_the_adaptive_part(shards):
    mix = mixture(shards, schedule=Adaptive(mixer.Weights(WEIGHTS), update_every=3))
    loader = mixer.make_loader(mix)
    take(Trained(loader), 7)
    state = json.loads(json.dumps(loader.state_dict()))
    a = state["adaptive"]
    assert a["updates"] == 2 and len(a["rows"]) == 2 and sum(a["counts"]) > 0  # step 6's loss is in the open window
    plain = mixer.make_loader(mixture(shards))
    assert plain.state_dict()["adaptive"] is None
    with pytest.raises(StateError, match=r"^adaptive state: unknown key 'x'"):
        mixer.make_loader(mix).load_state_dict({**state, "adaptive": {**a, "x": 1}})


def test_feedback_is_checked(shards):
    plain = mixer.make_loader(mixture(shards))
    batch = next(iter(plain))
    with pytest.raises(ConfigError, match=r"^feedback: the mixture's schedule is not mixer.Adaptive"):
        plain.feedback(batch, fake_loss(batch))
    loader = mixer.make_loader(mixture(shards, schedule=Adaptive(mixer.Weights(WEIGHTS))))
    batch = next(iter(loader))
    n = len(batch.source)  # (a batch may hold a single sample: one value too many is wrong whatever its size)
    with pytest.raises(
        ConfigError,
        match=re.escape(f"feedback: loss must have one value per sample of the batch, shape ({n},), got ({n + 1},)"),
    ):
        loader.feedback(batch, torch.zeros(n + 1))


def test_lag_below_what_the_loader_reads_ahead_is_refused(shards):
    mix = mixture(shards, schedule=Adaptive(mixer.Weights(WEIGHTS), lag=4))
    with pytest.raises(ConfigError, match=r"^Adaptive.lag: must be >= 5 with this loader .*got 4$"):
        mixer.make_loader(mix, num_workers=2)  # 2 x 2 in flight + 1


def test_exp_gradient_through_the_loader_matches_the_policy(shards):
    mix = mixture(
        shards, schedule=Adaptive(mixer.Weights(WEIGHTS), policy="exp_gradient", lr=2.0, update_every=3, smoothing=0.0)
    )
    got = run(mixer.make_loader(mix), 12)
    policy = ExpGradient(3, lr=2.0, smoothing=0.0)
    for j in range(3):
        sums, counts = np.zeros(3), np.zeros(3)
        for _, _, source, loss in got[j * 3 : j * 3 + 3]:
            np.add.at(sums, source.numpy(), loss.numpy())
            np.add.at(counts, source.numpy(), 1)
        row = policy.update(sums, counts, PRIOR, PRIOR)
        # Update j applies from step (j + 1) · 3 + 1.
        np.testing.assert_allclose(got[(j + 1) * 3 + 1][1], row, rtol=0, atol=1e-12)


def test_an_exhausted_source_keeps_its_weight_and_the_pass_delivers_everything_once(shards):
    # all_exhausted: 'tiny' (40 samples) runs out early; later windows have no sample of it, so
    # its adaptive weight stays where it was while the others keep moving.
    schedule = Adaptive(mixer.Weights(WEIGHTS), policy="exp_gradient", lr=2.0, update_every=3, smoothing=0.0)
    loader = mixer.make_loader(mixture(shards, schedule=schedule, stop="all_exhausted", state_every=1000))
    keys, rows, last_tiny = [], [], None
    for batch in Trained(loader):
        keys.extend(batch.keys)
        if 2 in batch.source.tolist():
            last_tiny = batch.meta.step
        rows = loader.state_dict()["adaptive"]["rows"]
    plain = [k for b in mixer.make_loader(mixture(shards, stop="all_exhausted")) for k in b.keys]
    assert sorted(keys) == sorted(plain) and len(keys) == len(set(keys))
    # Windows entirely after tiny's last batch: its share is constant, the others' change.
    after = [r for j, r in enumerate(rows) if j * 3 > last_tiny]
    assert len(after) >= 3
    assert len({r[2] for r in after}) == 1 and len({r[0] for r in after}) > 1


@pytest.mark.parametrize(
    "options,message",
    [
        (
            {"num_workers": 1, "persistent_workers": True},
            r"^schedule Adaptive: persistent_workers=True is not supported .*leave persistent_workers=False$",
        ),
        (
            {"num_workers": 1, "multiprocessing_context": "spawn"},
            r"^schedule Adaptive: needs DataLoader workers started by fork .*multiprocessing_context='fork' \(Linux\) "
            r"or num_workers=0$",
        ),
        (
            {"num_workers": 1, "multiprocessing_context": "forkserver"},
            r"^schedule Adaptive: needs DataLoader workers started by fork",
        ),
    ],
)
def test_workers_that_cannot_see_the_shares_table_are_refused_when_the_loader_is_made(shards, options, message):
    mix = mixture(shards, schedule=Adaptive(mixer.Weights(WEIGHTS)))
    with pytest.raises(ConfigError, match=message):
        mixer.make_loader(mix, **options)
    # the same options without adaptive mixing are fine, and so is fork without persistence
    mixer.make_loader(mixture(shards), **options)
    mixer.make_loader(mix, num_workers=1, multiprocessing_context="fork")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")
def test_feedback_on_cuda_losses_adapts_as_on_the_cpu(shards):
    # The loss stays on the GPU (accumulated there, copied once per window); the targets are those of
    # the same run with CPU losses, up to the order of the GPU's float64 additions.
    schedule = Adaptive(mixer.Weights(WEIGHTS), policy="exp_gradient", lr=3.0, update_every=4, smoothing=0.1, lag=9)
    got = {}
    for device in (None, "cuda"):
        loader = mixer.make_loader(mixture(shards, schedule=schedule), num_workers=2, device=device)
        rows = []
        for batch in loader:
            assert batch.source.device.type == ("cuda" if device else "cpu")
            loader.feedback(batch, fake_loss(batch))
            rows.append((list(batch.keys), batch.meta.target))
            if len(rows) == 30:
                break
        got[device] = rows
    assert [k for k, _ in got["cuda"]] == [k for k, _ in got[None]]
    np.testing.assert_allclose([t for _, t in got["cuda"]], [t for _, t in got[None]], rtol=0, atol=1e-12)
    assert got[None][0][1] != got[None][-1][1]

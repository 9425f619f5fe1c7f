"""The RL trainer's batching, its log-probs of rollout tokens against vLLM's behaviour log-probs (real vLLM
CPU build, the shared DeepSeek run of tests/conftest.py), and its bounded stop on SIGTERM."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from common.config import load_config
from rollout.client import RolloutClient, Sample
from rollout.generator import Rollout
from trainer.hf import load_hf_state
from trainer.model.sampling import RowSampling
from trainer.model.transformer import build_model
from trainer.rl.batch import padded_batch, sampling_rows
from trainer.role import stop_within
from trainer.tinykit import resolve_model


def rollout(prompt: list[int], tokens: list[int], logprobs: list[float]) -> Rollout:
    return Rollout(Sample(prompt, tokens, logprobs, [0] * len(tokens), "stop"), 1.0, "")


def test_padded_batch_aligns_completion_tokens_with_their_predicting_positions():
    batch = [rollout([5, 6, 7], [8, 9], [-0.5, -0.25]), rollout([5], [10, 11, 12], [-1.0, -2.0, -3.0])]
    tokens, targets, behaviour, mask = padded_batch(batch, pad_id=0)
    assert tokens.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 0]]
    # Position t predicts token t + 1: the first completion token is predicted at the last prompt position.
    assert targets.tolist() == [[-1, -1, 8, 9, -1], [10, 11, 12, -1, -1]]
    assert behaviour.tolist() == [[0, 0, -0.5, -0.25, 0], [-1.0, -2.0, -3.0, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]


# (temperature, top_k, top_p) the served model samples under in the test below: T = 1 over the whole vocabulary,
# tempered with a nucleus, and tempered with a top-k.
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 0.9), (0.8, 8, 1.0)]
# Mean |trainer - vLLM| (nats) a tempered setting may add over 10x T = 1's: float32 noise. Measured on the tiny
# kit (fp32, 4 prompts x 4 samples x 24 tokens): 1.3e-7 at T = 1, 1.6e-7 at (0.7, 0, 0.9), 1.0e-7 at (0.8, 8, 1);
# the T = 1 log-probs of the tempered samples are 0.12 and 2.5 nats off.
MISMATCH_FLOOR = 1e-6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_logprobs_of_rollout_tokens_match_vllm_behaviour_logprobs(deepseek_run):
    """fp32, the served checkpoint: mean |trainer - vLLM| over sampled tokens below 1e-3 nats at T = 1, and of
    the same order when vLLM samples tempered and truncated and the trainer takes its log-probs under each
    sample's own parameters (below 10x T = 1's plus a floor), which the plain T = 1 log-probs are far from."""
    cfg = load_config(deepseek_run.config)
    model_dir = resolve_model(cfg, deepseek_run.run_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["12+7=", "what is 3 plus 4?", "20-13=", "hello world"]

    async def sample_all() -> list[list[Sample]]:
        url = deepseek_run.router_url()
        async with RolloutClient(cfg.rollout.served_model_name, url=url, token=deepseek_run.secrets.router) as client:
            settings = await asyncio.gather(
                *(
                    asyncio.gather(
                        *(
                            client.generate(
                                tok(p)["input_ids"], n=4, temperature=T, top_k=k, top_p=top_p, max_tokens=24, seed=i
                            )
                            for i, p in enumerate(prompts)
                        )
                    )
                    for T, k, top_p in SETTINGS
                )
            )
        return [[s for g in groups for s in g] for groups in settings]

    samples = asyncio.run(sample_all())
    served_version = samples[0][0].versions[0]
    model = build_model(cfg.trainer.model, "reference", seed=None)
    load_hf_state(model, model_dir)
    model.eval()
    ours, plain = [], []
    for setting, drawn in zip(SETTINGS, samples, strict=True):
        batch = [Rollout(s, 0.0, "") for s in drawn]
        assert all((s.temperature, s.top_k, s.top_p) == setting for s in drawn)
        tokens, targets, behaviour, mask = padded_batch(batch, tok.pad_token_id)
        sampling = RowSampling(**sampling_rows(batch))
        with torch.no_grad():
            logp = model.token_logprobs(tokens, targets, sampling=sampling)
            outside = int(model.sampling_outside().sum())
            logp_t1 = model.token_logprobs(tokens, targets)
        assert mask.sum() >= 40, "too few sampled tokens to compare"
        ours.append(float(((logp - behaviour).abs() * mask).sum() / mask.sum()))
        plain.append(float(((logp_t1 - behaviour).abs() * mask).sum() / mask.sum()))
        worst = float(((logp - behaviour).abs() * mask).max())
        print(
            f"{setting}: mean |trainer - vLLM| = {ours[-1]:.3e} (max {worst:.3e}, {outside} outside), "
            f"T = 1 log-probs {plain[-1]:.3e}"
        )
    assert ours[0] < 1e-3, f"T = 1: mean |trainer - vLLM| = {ours[0]:.2e} nats"
    bound = 10 * ours[0] + MISMATCH_FLOOR
    for setting, mismatch, old in zip(SETTINGS[1:], ours[1:], plain[1:], strict=True):
        assert mismatch < bound, f"{setting}: mean |trainer - vLLM| = {mismatch:.2e} nats, above {bound:.2e}"
        assert old > bound, f"{setting}: the T = 1 log-probs ({old:.2e}) pass the bound; the test could not fail"
    # The served weights are the kit's checkpoint (tests that publish put it back), whatever its label.
    assert all(v == served_version for drawn in samples for s in drawn for v in s.versions)


@pytest.mark.timeout(60)
def test_waits_for_eval_see_results_before_and_during_the_wait_and_time_out(tmp_path):
    import threading
    import time

    from common.keys import Keys
    from common.rendezvous import Rendezvous
    from trainer.report import held_out_scores
    from trainer.rl.verdict import wait_for_eval, wait_for_evals

    rz = Rendezvous(tmp_path / "meet")
    try:
        client, keys = rz.connect(), Keys("t-report")
        client.xadd(keys.evals, {"version": 3, "benchmark": "arithmetic", "score": 0.5, "ts": 0})
        assert wait_for_eval(client, keys, 3, "arithmetic", timeout_s=0)
        assert wait_for_eval(client, keys, 2, "arithmetic", timeout_s=0)  # a newer version answers too
        start = time.monotonic()
        assert not wait_for_eval(client, keys, 5, "arithmetic", timeout_s=0.5)
        assert 0.4 < time.monotonic() - start < 3
        later = threading.Timer(
            0.3, client.xadd, (keys.evals, {"version": 5, "benchmark": "arithmetic", "score": 0.75, "ts": 0})
        )
        later.start()
        assert wait_for_eval(client, keys, 5, "arithmetic", timeout_s=10)
        assert held_out_scores(client, keys, "arithmetic") == {3: 0.5, 5: 0.75}

        # Every due version: a pinning evaluator backfills older versions after the newest.
        assert wait_for_evals(client, keys, {3, 5}, "arithmetic", timeout_s=0) == set()
        assert wait_for_evals(client, keys, {0, 3, 5}, "arithmetic", timeout_s=0.3) == {0}
        assert wait_for_evals(client, keys, set(), "arithmetic", timeout_s=30) == set()
        backfill = threading.Timer(
            0.3, client.xadd, (keys.evals, {"version": 0, "benchmark": "arithmetic", "score": 0.25, "ts": 0})
        )
        backfill.start()
        assert wait_for_evals(client, keys, {0, 3, 5}, "arithmetic", timeout_s=10) == set()
        assert wait_for_evals(client, keys, {0, 7}, "ifeval", timeout_s=0) == {0, 7}
    finally:
        rz.close()


@pytest.mark.timeout(60)
def test_the_end_of_run_wait_covers_every_benchmark_of_the_last_version(tmp_path, caplog):
    """The evaluator measures a version's benchmarks one after another: a trainer that ended at the first one's
    result tore the evaluator down in the middle of the second (test_rl_e2e's EP 2 run lost its last
    arithmetic_train score). The wait ends when every benchmark has answered, or at its bound, naming the late."""
    from common.config import EvaluatorConfig
    from common.keys import Keys
    from common.rendezvous import Rendezvous
    from trainer.rl.verdict import wait_for_verdict

    rz = Rendezvous(tmp_path / "meet")
    try:
        client, keys = rz.connect(), Keys("t-verdict")
        client.set(keys.role_alive("evaluator", "e-0"), "1")  # a live evaluator
        ev = EvaluatorConfig(benchmarks=["arithmetic", "arithmetic_train"], every_n_versions=5)
        client.xadd(keys.evals, {"version": 15, "benchmark": "arithmetic", "score": 0.5, "ts": 0})
        second = {"version": 15, "benchmark": "arithmetic_train", "score": 0.7, "ts": 0}
        threading.Timer(0.5, client.xadd, (keys.evals, second)).start()
        start = time.monotonic()
        wait_for_verdict(client, keys, ev, 16, range(17), wait_s=20)
        assert 0.4 < time.monotonic() - start < 10
        ev = EvaluatorConfig(benchmarks=["arithmetic", "words"], every_n_versions=5)
        start = time.monotonic()
        wait_for_verdict(client, keys, ev, 15, range(16), wait_s=0.5)
        assert 0.4 < time.monotonic() - start < 5
        assert "no words result for version 15 yet" in caplog.text
    finally:
        rz.close()


def test_a_stop_that_blocks_does_not_hold_the_trainer_role_on_sigterm(caplog):
    """The trainer role's SIGTERM path calls the trainer's stop through `stop_within`: a stop blocked on a lock
    nobody releases (here an Event; in CI once tqdm's write lock, taken by the controller's progress bar) is
    left behind in its daemon thread after the bound, with an error, and a quick stop returns True."""
    never = threading.Event()
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="trainer.role"):
        assert stop_within(never.wait, 0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert "stopping the trainer did not return within 0s" in caplog.text
    assert stop_within(lambda: None, 5.0) is True
    never.set()

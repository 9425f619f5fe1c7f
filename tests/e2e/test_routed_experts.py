"""Routed experts from real vLLM (CPU build, our plugin driving vLLM's aux-output connector): every
sample carries, for every position of prompt + completion but the last, the top-k experts each MoE
layer chose, equal to what the trainer's own router chooses for the same tokens and weights (fp32);
samples of one prompt carry identical prompt rows; a prompt served from the prefix cache still gets
every row (Qwen3-MoE: DeepSeek's MLA runs without prefix caching on CPU); across a keep-mode publish
each row comes from the weights that sampled the next token. Workers are the shared ones of conftest.py,
started with rollout.return_routed_experts (the default)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import torch
from test_rollout_vllm import (
    LONG,
    PROMPT,
    hf_model,
    model_dir,
    next_version,
    perturb,
    publisher,
    restore,
    until_running,
    worker_url,
)

from rollout.client import RolloutClient, Sample
from trainer.hf import import_hf, load_hf_state
from trainer.rl.replay import routing_batch

pytestmark = [pytest.mark.slow]


def trainer_routing(model, samples: list[Sample]) -> dict[int, np.ndarray]:
    """Per MoE layer, the sorted expert ids [B, S, k] the trainer's routers choose over each sample's tokens
    (hooks on each MoE layer's `gate`, whose forward returns (weights, ids, scores)); samples of one length."""
    seqs = torch.tensor([s.prompt_token_ids + s.token_ids for s in samples])
    caught: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[layer].mlp.gate.register_forward_hook(
            lambda _m, _in, out, layer=layer: caught.__setitem__(layer, out[1])
        )
        for layer in model.moe_layer_ids()
    ]
    try:
        with torch.no_grad():
            model(seqs)
    finally:
        for h in hooks:
            h.remove()
    return {layer: np.sort(ids.view(*seqs.shape, -1).numpy(), axis=-1) for layer, ids in caught.items()}


def mismatches(sample: Sample, reference: dict[int, np.ndarray], row: int, positions=None) -> list[tuple[int, int]]:
    """(position, layer) pairs where the sample's experts differ from reference[layer][row] (sorted sets)."""
    n = len(sample.routed_experts)
    keep = np.ones(n, bool) if positions is None else positions
    out = []
    for layer, ref in reference.items():
        got = np.sort(sample.routed_experts[:, layer].astype(np.int64), axis=-1)
        differ = (got != ref[row, :n]).any(-1) & keep
        out += [(int(p), layer) for p in np.nonzero(differ)[0]]
    return out


@pytest.mark.timeout(300)
async def test_every_position_carries_the_experts_the_trainer_router_chooses_deepseek(deepseek_run):
    run = deepseek_run
    model = import_hf(model_dir(run)).eval()
    cfg = model.cfg
    r = run.rz.async_client()
    async with RolloutClient(
        "policy", redis_client=r, keys=run.keys, token=run.secrets.router
    ) as client:  # through the router
        samples = await client.generate(PROMPT, n=4, max_tokens=32, seed=5, group="re", ignore_eos=True)
    await r.aclose()
    moe = model.moe_layer_ids()
    dense = [layer for layer in range(cfg.num_layers) if layer not in moe]
    assert moe and dense, "the tiny DeepSeek has a dense first layer and MoE layers"
    for s in samples:
        rows = s.routed_experts
        assert rows is not None and rows.dtype == np.uint8
        assert rows.shape == (len(PROMPT) + 32 - 1, cfg.num_layers, cfg.num_experts_per_tok)
        assert (rows[:, dense] == 0).all(), "dense layers' rows are vLLM's zeros"
        chosen = np.sort(rows[:, moe], axis=-1)
        assert (chosen < cfg.n_routed_experts).all()
        assert (np.diff(chosen.astype(int), axis=-1) > 0).all(), "a row repeats an expert"
        assert len({tuple(c.ravel()) for c in chosen}) > 1, "every position routed alike"
        # The prompt's rows (its last position included: it sampled token 0) are the same for all samples.
        assert (rows[: len(PROMPT)] == samples[0].routed_experts[: len(PROMPT)]).all()
    reference = trainer_routing(model, samples)
    bad = {i: mismatches(s, reference, i) for i, s in enumerate(samples)}
    assert not any(bad.values()), f"(position, layer) pairs where vLLM's experts differ from the trainer's: {bad}"


@pytest.mark.timeout(400)
async def test_a_prompt_served_from_the_prefix_cache_gets_every_row_qwen3(qwen3_run):
    run = qwen3_run
    model = import_hf(model_dir(run)).eval()
    # Longer than two of the CPU backend's 128-token blocks, so the second request hits two cached blocks.
    prompt = torch.randint(8, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    url = worker_url(run)
    async with RolloutClient("policy", url=url, token=run.secrets.workers) as client, run.worker_session() as http:
        (first,) = await client.generate(prompt, max_tokens=8, seed=1, ignore_eos=True)
        before = await prefix_cache_hits(http, url)
        (second,) = await client.generate(prompt, max_tokens=8, seed=2, ignore_eos=True)
        hits = await prefix_cache_hits(http, url) - before
    assert hits >= 256, f"the second request did not hit the prefix cache ({hits} cached tokens)"
    for s in (first, second):
        assert s.routed_experts is not None and len(s.routed_experts) == len(prompt) + 8 - 1
    assert (second.routed_experts[: len(prompt)] == first.routed_experts[: len(prompt)]).all()
    reference = trainer_routing(model, [first, second])
    bad = {i: mismatches(s, reference, i) for i, s in enumerate((first, second))}
    assert not any(bad.values()), f"(position, layer) pairs where vLLM's experts differ from the trainer's: {bad}"


async def prefix_cache_hits(http: aiohttp.ClientSession, url: str) -> float:
    """Prompt tokens vLLM has served from its prefix cache so far."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    )


@pytest.mark.timeout(400)
async def test_across_a_keep_mode_publish_rows_come_from_the_sampling_weights(deepseek_run):
    """Across a keep-mode publish, each row comes from the weights that sampled the next token."""
    run = deepseek_run
    old_model = import_hf(model_dir(run)).eval()
    r = run.rz.async_client()
    url = worker_url(run)
    async with RolloutClient("policy", url=url, token=run.secrets.workers) as client, publisher(run, r, "keep") as pub:
        old = int(await r.get(run.keys.weights_current) or 0)
        new = await next_version(run, r)
        weights = perturb(hf_model(model_dir(run)), seed=new)
        # 8 samples of one request (vLLM adds them to the engine together), about 28 s of decoding here.
        n, max_tokens = 8, LONG
        timeline: dict[str, float] = {}
        t0 = time.perf_counter()
        task = asyncio.create_task(client.generate(PROMPT, n=n, max_tokens=max_tokens, seed=9, ignore_eos=True))
        task.add_done_callback(lambda _: timeline.setdefault("requests done", time.perf_counter() - t0))
        await until_running(run, url, n, requests=[task])
        timeline["running"] = time.perf_counter() - t0
        await asyncio.sleep(0.1)  # a few decode steps on the old weights
        # Freeze the requests before the publish (as test_rollout_vllm's _in_flight_publish does): the busy engine
        # slows this process down many times over, and CI once saw the running requests only 12.4 s into 13.1 s
        # of decoding, so that they finished, all on the old weights, before the publish landed. The publish's
        # own keep-mode pause then acts on frozen requests, and its resume lets them go on with the new weights.
        async with run.worker_session() as http, http.post(f"{url}/pause", params={"mode": "keep"}) as resp:
            assert resp.status == 200, await resp.text()
        timeline["frozen"] = time.perf_counter() - t0
        assert not task.done(), f"the requests finished before the pause; raise max_tokens (timeline {timeline})"
        timeline["publish called"] = time.perf_counter() - t0
        result = await pub.publish(new, weights)
        timeline["publish returned"] = time.perf_counter() - t0
        samples = await task
        try:
            new_model = import_hf(model_dir(run)).eval()
            load_hf_state(new_model, result.location)
        finally:
            await restore(run, r, pub)
    await r.aclose()
    old_routing, new_routing = trainer_routing(old_model, samples), trainer_routing(new_model, samples)
    # The message tells the timing and the publish.
    said = f"timeline (s): {timeline}; publish: {result}; the requests went to {url}"
    assert url in [w.url for w in result.workers if w.ok], f"the publish did not update the serving worker; {said}"
    for i, s in enumerate(samples):
        assert old in s.versions and new in s.versions, (
            f"sample {i}: versions {[(v, s.versions.count(v)) for v in sorted(set(s.versions))]}; {said}"
        )
        assert len(s.routed_experts) == len(PROMPT) + max_tokens - 1
        # Row p is the forward that took token p and sampled token p + 1, i.e. completion token p + 1 - len(prompt).
        row_version = np.array([s.versions[max(0, p + 1 - len(PROMPT))] for p in range(len(s.routed_experts))])
        bad_old = mismatches(s, old_routing, i, row_version == old)
        bad_new = mismatches(s, new_routing, i, row_version == new)
        assert not bad_old and not bad_new, (
            f"sample {i}: rows unlike the weights that made them: old {bad_old}, new {bad_new}"
        )


@pytest.mark.timeout(300)
async def test_with_a_perturbed_router_bias_replay_gives_back_vllms_log_probs_deepseek(deepseek_run):
    """The acceptance of rollout routing replay: the trainer (fp32, the worker's weights) agrees with vLLM on
    every expert; after its router bias is perturbed it disagrees on some token-layer pairs and its log-probs
    of the sampled tokens move away from vLLM's; replaying vLLM's routing brings them back within 1e-5."""
    run = deepseek_run
    model = import_hf(model_dir(run)).eval()
    async with RolloutClient("policy", url=worker_url(run), token=run.secrets.workers) as client:
        samples = await client.generate(PROMPT, n=4, max_tokens=32, seed=11, ignore_eos=True)  # temperature 1
    tokens = torch.tensor([s.prompt_token_ids + s.token_ids for s in samples])
    P = len(PROMPT)
    targets = torch.full_like(tokens, -1)
    targets[:, P - 1 : -1] = tokens[:, P:]
    behaviour = torch.tensor([s.logprobs for s in samples], dtype=torch.float64)
    routing = routing_batch(samples, tokens.shape[1], model.moe_layer_ids(), model.cfg.num_experts_per_tok)

    def gap(replay: bool) -> tuple[torch.Tensor, float]:
        """|trainer - vLLM| per sampled token, and the disagreement of the trainer's own routing with vLLM's."""
        with torch.no_grad():
            logp = model.token_logprobs(tokens, targets, routing=routing, replay=replay)[:, P - 1 : -1]
        differ, compared = model.routing_disagreement()
        return (logp.double() - behaviour).abs(), float(differ.sum() / compared.sum())

    same, disagreement = gap(replay=False)
    assert disagreement == 0.0
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.add_(0.05 * torch.randn(m.num_experts, generator=gen))
    moved, disagreement = gap(replay=False)
    back, replayed_disagreement = gap(replay=True)
    print(
        f"|trainer - vLLM| log-prob: own routing max {float(same.max()):.2e} mean {float(same.mean()):.2e}; "
        f"bias perturbed: max {float(moved.max()):.2e} (disagreement {disagreement:.3f}); "
        f"replayed: max {float(back.max()):.2e} mean {float(back.mean()):.2e}"
    )
    assert disagreement > 0 and replayed_disagreement == disagreement  # still measured against the own choice
    assert float(moved.max()) > 1e-3
    assert float(back.max()) <= 1e-5

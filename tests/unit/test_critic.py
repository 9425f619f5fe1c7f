"""trainer.rl.algorithm = "ppo": the GAE, whitening, clipped value loss and dual-clip against float64
computations written out by hand on a fixed ragged batch; the PPO step on the core against one written out
by hand; two expert-parallel ranks against one; the critic's warm-up; its checkpoint and exact resume; and
the config's refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from common.config import Config, ConfigError, load_config
from trainer.core import TrainingCore
from trainer.model import build_model
from trainer.model.sampling import RowSampling
from trainer.ranks import RankInfo, Ranks
from trainer.rl.critic import ValueModel, build_critic, ppo_step, value_model
from trainer.rl.gae import gae, token_rewards, value_loss, whiten
from trainer.rl.loss import ppo_loss

# Three rows of a step: completions of 3, 1 and 2 tokens after prompts of different lengths, right-padded.
MASK = torch.tensor(
    [
        [0, 1, 1, 1, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 1, 1, 0],
    ],
    dtype=torch.float64,
)
REWARDS = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
VALUES = torch.tensor(
    [
        [9.0, 0.2, 0.4, 0.6, 9.0],
        [9.0, 9.0, 9.0, 0.3, 9.0],
        [9.0, 9.0, -0.1, 0.1, 9.0],
    ],
    dtype=torch.float64,
)  # 9.0: positions outside the completion, which must play no part


def _gae_by_hand(gamma: float, lam: float) -> list[list[float]]:
    """Each row's completion as a list, walked backwards with the textbook recursion."""
    out = []
    for b in range(3):
        idx = [t for t in range(5) if MASK[b, t] > 0]
        v = [float(VALUES[b, t]) for t in idx]
        r = [0.0] * len(idx)
        r[-1] = float(REWARDS[b])
        adv, nxt_v, nxt_a = [0.0] * len(idx), 0.0, 0.0
        for i in reversed(range(len(idx))):
            delta = r[i] + gamma * nxt_v - v[i]
            adv[i] = delta + gamma * lam * nxt_a
            nxt_v, nxt_a = v[i], adv[i]
        row = [0.0] * 5
        for i, t in enumerate(idx):
            row[t] = adv[i]
        out.append(row)
    return out


def test_the_reward_sits_on_the_last_completion_token_of_each_row():
    r = token_rewards(REWARDS, MASK)
    assert r.tolist() == [[0, 0, 0, 1.0, 0], [0, 0, 0, 0.0, 0], [0, 0, 0, 0.5, 0]]
    with pytest.raises(ValueError, match=r"rows \[1\] have no completion token"):
        token_rewards(REWARDS, torch.tensor([[1.0, 0], [0, 0], [0, 1.0]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0)])
def test_gae_is_the_backward_recursion_over_each_rows_completion(gamma, lam):
    adv, ret = gae(token_rewards(REWARDS, MASK), VALUES, MASK, gamma, lam)
    expected = torch.tensor(_gae_by_hand(gamma, lam), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, (expected + VALUES) * MASK, rtol=0, atol=1e-12)
    if gamma == lam == 1.0:  # the undiscounted lambda = 1 advantage: the sample's reward minus the token's value
        torch.testing.assert_close(adv, (REWARDS[:, None] - VALUES) * MASK, rtol=0, atol=1e-12)


def test_whitening_is_over_every_masked_token_of_the_step():
    x = torch.tensor([[5.0, 1, 2, 3, 5], [5, 5, 5, 4, 5], [5, 5, 6, 7, 5]], dtype=torch.float64)
    tokens = [1.0, 2, 3, 4, 6, 7]
    mean = sum(tokens) / 6
    std = (sum((t - mean) ** 2 for t in tokens) / 6 + 1e-8) ** 0.5
    expected = ((x - mean) / std) * MASK
    torch.testing.assert_close(whiten(x, MASK), expected, rtol=0, atol=1e-12)
    w = whiten(x, MASK)[MASK > 0]
    assert abs(float(w.mean())) < 1e-12 and abs(float(w.pow(2).mean()) - 1) < 1e-6


def test_the_clipped_value_loss_takes_the_larger_of_the_two_squared_errors():
    new = torch.tensor([0.0, 1.0, -1.0, 0.55], dtype=torch.float64)
    old = torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64)
    ret = torch.tensor([1.0, 0.0, -2.0, 0.6], dtype=torch.float64)
    loss, clipped = value_loss(new, old, ret, 0.2)
    # By hand: clip(new, old +- 0.2) = [0, 0.7, -0.2, 0.55].
    by_hand = [0.5 * max(1.0, 1.0), 0.5 * max(1.0, 0.49), 0.5 * max(1.0, 1.8**2), 0.5 * max(0.05**2, 0.05**2)]
    torch.testing.assert_close(loss, torch.tensor(by_hand, dtype=torch.float64), rtol=0, atol=1e-12)
    assert clipped.tolist() == [False, False, True, False]
    plain, none = value_loss(new, old, ret, 0.0)
    torch.testing.assert_close(plain, 0.5 * (new - ret) ** 2)
    assert not none.any()


def test_dual_clip_bounds_the_surrogate_of_negative_advantages_only():
    cfg = Config().trainer.rl
    cfg.dual_clip = 3.0
    logp = torch.log(torch.tensor([[5.0, 5.0, 0.5, 1.1]], dtype=torch.float64))
    zero = torch.zeros_like(logp)
    adv = torch.tensor([[-1.0, 2.0, -1.0, -0.5]], dtype=torch.float64)  # token-level advantages
    mask = torch.ones_like(logp)
    out = ppo_loss(logp, zero, zero, adv, mask, cfg)
    # Ratios 5, 5, 0.5, 1.1 (iw = 1): surrogate min(r A, clip(r) A) with clip to [0.8, 1.28], then max(., 3A) for A < 0.
    by_hand = [max(min(-5.0, -1.28), -3.0), min(10.0, 2.56), max(min(-0.5, -0.8), -3.0), max(min(-0.55, -0.55), -1.5)]
    assert abs(out.stats["pg_loss"] - (-sum(by_hand) / 4)) < 1e-12
    assert out.stats["dual_clip_fraction"] == 0.25
    cfg.dual_clip = 0.0
    off = ppo_loss(logp, zero, zero, adv, mask, cfg)
    assert abs(off.stats["pg_loss"] - (-(-5.0 + 2.56 - 0.8 - 0.55) / 4)) < 1e-12
    # A [B] advantage is each token's of its row, as before.
    per_row = ppo_loss(logp, zero, zero, torch.tensor([2.0], dtype=torch.float64), mask, cfg)
    per_token = ppo_loss(logp, zero, zero, torch.full((1, 4), 2.0, dtype=torch.float64), mask, cfg)
    assert per_row.stats["pg_loss"] == per_token.stats["pg_loss"]


def test_ppo_config_refusals_name_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="trainer.rl.dual_clip = 0.5"):
        load_config(None, ["trainer.rl.dual_clip=0.5"])
    with pytest.raises(ConfigError, match="trainer.rl.critic.lr"):
        load_config(None, ["trainer.rl.algorithm=ppo", "trainer.rl.critic.lr=0"])
    with pytest.raises(ConfigError, match="warmup_steps = 5 leaves none of trainer.steps = 5"):
        load_config(None, ["trainer.rl.algorithm=ppo", "trainer.rl.critic.warmup_steps=5", "trainer.steps=5"])
    with pytest.raises(ConfigError, match="gae_lambda"):
        load_config(None, ["trainer.rl.algorithm=ppo", "trainer.rl.gae_lambda=1.5"])
    cfg = load_config(None, ["trainer.rl.algorithm=ppo", "trainer.rl.critic.warmup_steps=4", "trainer.steps=5"])
    assert cfg.trainer.rl.critic.warmup_steps == 4  # one step left to the policy is enough


# -- the PPO step on the core ----------------------------------------------------------------------


def _ppo_config(warmup: int = 0) -> Config:
    cfg = Config()
    cfg.trainer.rl.algorithm = "ppo"
    cfg.trainer.rl.critic.value_clip = 0.01  # small enough that value clipping acts on these steps
    cfg.trainer.rl.critic.warmup_steps = warmup
    cfg.trainer.rl.dual_clip = 3.0
    cfg.trainer.rl.gae_lambda = 0.95
    return cfg


def _ppo_batch() -> tuple[dict[str, torch.Tensor], list[slice]]:
    """An RL step of 6 groups of 4 samples with completions of different lengths and 0/1 rewards, cut into
    3 mini-batches."""
    from trainer.rl.update import mini_batch_rows

    g = torch.Generator().manual_seed(7)
    N, L = 24, 10
    tokens, targets = torch.randint(0, 128, (N, L), generator=g), torch.randint(0, 128, (N, L), generator=g)
    targets[:, :4] = -1
    targets[::3, -3:] = -1  # ragged completions
    mask = (targets >= 0).float()
    batch = {
        "tokens": tokens,
        "targets": targets,
        "behaviour": -torch.rand(N, L, generator=g) * mask,
        "mask": mask,
        "rewards": torch.randint(0, 2, (N,), generator=g).float(),
        "fresh": torch.ones(N),
        "step_tokens": torch.full((N,), float(mask.sum())),
        # Sampled at temperature 0.7, half the rows with top-p 0.9: the policy's log-probs are of that distribution.
        "temperature": torch.full((N,), 0.7),
        "top_k": torch.zeros(N, dtype=torch.long),
        "top_p": torch.tensor([1.0, 0.9] * (N // 2)),
    }
    return batch, mini_batch_rows([4] * 6, 3)


def _one_rank(cfg: Config) -> tuple[TrainingCore, TrainingCore]:
    ranks = Ranks.single(torch.device("cpu"))
    core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
    return core, build_critic(cfg, ranks, core.model)


@torch.no_grad()
def _trained_head(critic: TrainingCore) -> TrainingCore:
    """A critic whose values are not all 0 (as after some training), so that the step's old values, GAE and
    value clipping all act: the same random head on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    head = value_model(critic.model).value_head
    for p, full in (
        (head.weight, torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.3),
        (head.bias, torch.full(head.bias.shape, 0.4)),
    ):
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
    return critic


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_critic_starts_as_the_policys_trunk_with_a_zero_value_head():
    cfg = _ppo_config()
    core, critic = _one_rank(cfg)
    policy, values = core.model.state_dict(), value_model(critic.model).state_dict()
    assert set(values) - set(policy) == {"value_head.weight", "value_head.bias"}
    assert all(torch.equal(values[k], policy[k]) for k in values if not k.startswith("value_head."))
    batch, _ = _ppo_batch()
    with torch.no_grad():
        assert float(critic.model(batch["tokens"]).abs().max()) == 0.0


def test_copying_the_trunk_again_after_the_warm_start_takes_the_policys_new_weights():
    """The start of RL (StartRL, after the warm start) copies the trained policy's trunk into the critic again."""
    from trainer.core import cross_entropy_loss
    from trainer.rl.critic import copy_trunk

    cfg = _ppo_config()
    core, critic = _one_rank(cfg)
    batch, _ = _ppo_batch()
    sft = {"tokens": batch["tokens"], "targets": batch["targets"]}
    core.step(sft, cross_entropy_loss(int(batch["mask"].sum())), 8, tokens=0, lr=1e-2)
    trunk = {k: v for k, v in core.model.state_dict().items() if not k.startswith("lm_head.")}
    assert any(not torch.equal(v, critic.model.state_dict()[k]) for k, v in trunk.items())
    copy_trunk(core.model, value_model(critic.model))
    assert all(torch.equal(v, critic.model.state_dict()[k]) for k, v in trunk.items())


def test_the_ppo_step_on_the_core_is_the_one_written_out_by_hand():
    """Old values (no grad, eval mode), GAE and whitening, then per mini-batch the policy's PPO update with
    token advantages and the critic's clipped value update, each normalised by the mini-batch's tokens."""
    from trainer.optim import Optimizer
    from trainer.rl.critic import critic_config

    cfg = _ppo_config()
    rl = cfg.trainer.rl
    mb = rl.micro_batch_samples
    batch, rows = _ppo_batch()
    core, critic = _one_rank(cfg)
    _trained_head(critic)
    policy_hand, critic_hand = copy.deepcopy(core.model), copy.deepcopy(value_model(critic.model))

    result = ppo_step(core, critic, batch, rows, rl, train_policy=True)

    tokens, targets, mask, N = batch["tokens"], batch["targets"], batch["mask"], len(batch["tokens"])

    def sampled(c: slice) -> RowSampling:
        return RowSampling(batch["temperature"][c], batch["top_k"][c], batch["top_p"][c])

    with torch.no_grad():
        policy_hand.eval(), critic_hand.eval()
        chunks = [slice(i, i + mb) for i in range(0, N, mb)]
        proximal = torch.cat([policy_hand.token_logprobs(tokens[c], targets[c], sampling=sampled(c)) for c in chunks])
        values = torch.cat([critic_hand(tokens[c]) for c in chunks]) * mask
    policy_hand.train(), critic_hand.train()
    adv, ret = gae(token_rewards(batch["rewards"], mask), values, mask, rl.gamma, rl.gae_lambda)
    white = whiten(adv, mask)
    policy_opt = Optimizer(policy_hand, cfg.trainer.optim)
    critic_opt = Optimizer(critic_hand, critic_config(cfg).trainer.optim)
    value_losses = []
    for r in rows:
        total = float(mask[r].sum())
        for i in range(r.start, r.stop, mb):
            c = slice(i, min(i + mb, r.stop))
            logp = policy_hand.token_logprobs(tokens[c], targets[c], sampling=sampled(c))
            ppo_loss(logp, proximal[c], batch["behaviour"][c], white[c], mask[c], rl, total=total).loss.backward()
        policy_opt.step(int(total))
        for i in range(r.start, r.stop, mb):
            c = slice(i, min(i + mb, r.stop))
            per_token, _ = value_loss(critic_hand(tokens[c]), values[c], ret[c], rl.critic.value_clip)
            loss = (per_token * mask[c]).sum() / total
            loss.backward()
            value_losses.append(float(loss) * total / float(mask.sum()))
        critic_opt.step(int(total))

    assert len(result.updates) == 3 and critic.optimizer.steps == 3
    assert abs(result.figures["critic/value_loss"] - sum(value_losses)) < 1e-6
    assert result.figures["rl/policy_trained"] == 1.0
    assert 0 < result.figures["critic/value_clip_fraction"] < 1
    assert float(values.abs().max()) > 0.1
    start_policy = _flat(build_model(cfg.trainer.model, seed=0))
    start_critic = _flat(_trained_head(_one_rank(cfg)[1]).model)
    for hand, mine, start in ((policy_hand, core.model, start_policy), (critic_hand, critic.model, start_critic)):
        a, b = _flat(hand), _flat(mine)
        assert float((a - start).norm()) > 0.01  # it moved
        assert float((a - b).norm() / (a - start).norm()) < 1e-3
    assert float(value_model(critic.model).value_head.weight.abs().max()) > 0  # the critic learned something


def test_the_critics_warm_up_leaves_the_policy_bitwise_unchanged_and_moves_the_critic():
    cfg = _ppo_config(warmup=1)
    core, critic = _one_rank(cfg)
    policy_before, critic_before = _flat(core.model).clone(), _flat(critic.model).clone()
    batch, rows = _ppo_batch()
    result = ppo_step(core, critic, batch, rows, cfg.trainer.rl, train_policy=False)
    assert torch.equal(_flat(core.model), policy_before)
    assert core.optimizer.steps == 0 and result.updates == []
    assert float((_flat(critic.model) - critic_before).norm()) > 0
    assert result.figures["rl/policy_trained"] == 0.0 and "critic/value_loss" in result.figures


def test_save_after_a_ppo_step_and_resume_into_fresh_cores_gives_the_uninterrupted_next_step(tmp_path):
    from trainer.checkpoint import Companion, TrainState

    cfg = _ppo_config()
    cfg.trainer.checkpoint.resume = True
    batch, rows = _ppo_batch()
    second = {k: v.flip(0) for k, v in batch.items()}  # another step's rows

    core, critic = _one_rank(cfg)
    _trained_head(critic)
    core.companions["critic"] = Companion(critic.model, critic.optimizer)
    ppo_step(core, critic, batch, rows, cfg.trainer.rl, train_policy=True)
    core.save(tmp_path, TrainState(step=1))
    uninterrupted = ppo_step(core, critic, second, rows, cfg.trainer.rl, train_policy=True)

    fresh, fresh_critic = _one_rank(cfg)
    fresh.companions["critic"] = Companion(fresh_critic.model, fresh_critic.optimizer)
    state = fresh.resume(tmp_path)
    assert state is not None and state.step == 1 and fresh_critic.optimizer.steps == 3
    resumed = ppo_step(fresh, fresh_critic, second, rows, cfg.trainer.rl, train_policy=True)
    for k in ("loss", "pg_loss", "critic/value_loss", "critic/explained_variance", "rl/advantage_std"):
        assert resumed.figures[k] == uninterrupted.figures[k], k
    assert torch.equal(_flat(fresh.model), _flat(core.model))
    assert torch.equal(_flat(fresh_critic.model), _flat(critic.model))

    # A run that keeps a critic refuses a checkpoint written without one, naming it.
    plain, _ = _one_rank(Config())
    plain.save(tmp_path / "plain", TrainState(step=1))
    other, other_critic = _one_rank(cfg)
    other.companions["critic"] = Companion(other_critic.model, other_critic.optimizer)
    from trainer.checkpoint import CheckpointMismatch, load_checkpoint

    with pytest.raises(CheckpointMismatch, match="no critic model"):
        load_checkpoint(tmp_path / "plain" / "step_00000001", other.model, other.optimizer, Config(), other.companions)


# -- two expert-parallel ranks -----------------------------------------------------------------------


def _ppo_on_ranks(rank: int, world: int, store: str, out: str, dp_shard: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _ppo_config()
        cfg.trainer.parallel.ep, cfg.trainer.parallel.dp_shard = world // dp_shard, dp_shard
        ranks = Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)
        core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
        critic = _trained_head(build_critic(cfg, ranks, core.model))
        batch, rows = _ppo_batch()
        result = ppo_step(core, critic, batch, rows, cfg.trainer.rl, train_policy=True)
        critic_part = {n: t.detach().clone() for n, t in _critic_tensors(critic.model)}
        torch.save({"part": core.hf_part(), "critic": critic_part, "figures": result.figures}, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _critic_tensors(model: ValueModel) -> list[tuple[str, torch.Tensor]]:
    """The critic's parameters as this rank holds them (its own experts' shards, the replicated rest)."""
    from torch.distributed.tensor import DTensor

    return [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]


@pytest.mark.parametrize("dp_shard", [1, 2])
def test_a_ppo_step_on_two_expert_parallel_ranks_is_the_one_rank_step(tmp_path, dp_shard):
    """Old values gathered over the ranks, GAE and whitening over the global step, the policy's and the
    critic's updates each split over the ranks: 2 ranks (EP = 2, real gloo processes) make one rank's step.
    With dp_shard = 2 the 2 ranks shard the dense weights of the policy and the critic instead (FSDP2), and
    hold the experts whole."""
    import torch.multiprocessing as mp

    from tests.unit.test_core import EP_STEP_BOUND, worst_relative_difference
    from trainer.hf import hf_tensors

    mp.spawn(_ppo_on_ranks, args=(2, str(tmp_path / "store"), str(tmp_path), dp_shard), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cfg = _ppo_config()
    core, critic = _one_rank(cfg)
    _trained_head(critic)
    start_policy = {name: t.clone() for name, t in hf_tensors(core.model)}
    start_critic = {name: t.detach().clone() for name, t in critic.model.named_parameters()}
    batch, rows = _ppo_batch()
    one = ppo_step(core, critic, batch, rows, cfg.trainer.rl, train_policy=True)

    two_policy = parts[0]["part"] | parts[1]["part"]
    worst, difference = worst_relative_difference(two_policy, dict(hf_tensors(core.model)), start_policy)
    assert difference <= EP_STEP_BOUND, worst
    # EP: rank r holds experts [r * E/2, (r + 1) * E/2) of each layer; the rest is replicated. dp_shard: rank r
    # holds the r-th block of rows of each dense tensor (torch.chunk's), the experts whole.
    two_critic = {}
    for name, t in parts[0]["critic"].items():
        other = parts[1]["critic"][name]
        two_critic[name] = torch.cat([t, other]) if (".mlp.experts." in name) == (dp_shard == 1) else t
    mine = {name: p.detach() for name, p in critic.model.named_parameters()}
    worst, difference = worst_relative_difference(two_critic, mine, start_critic)
    assert difference <= EP_STEP_BOUND, worst
    for k in ("loss", "pg_loss", "critic/value_loss", "critic/explained_variance", "rl/advantage_std", "tokens"):
        assert abs(parts[0]["figures"][k] - one.figures[k]) <= 1e-5 * max(1.0, abs(one.figures[k])), k


# -- the driver ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_rl_trainer_runs_ppo_logs_the_critic_and_resumes_it_from_its_checkpoint(tmp_path):
    """An in-process RL run (fake router, 2 prompts x 4 samples a step) with algorithm = ppo and one warm-up
    step: step 0 trains only the critic, later steps both; every step logs the critic's figures. Extended
    from 2 to 3 steps, the run resumes the critic from the checkpoint (a missing one would fail the load)."""
    from common.config import RendezvousConfig
    from common.metrics import step_series
    from common.rendezvous import Rendezvous
    from tests.unit.test_gen_metrics import context, rl_config, trainer_world
    from trainer.rl.driver import RLTrainer

    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    run_dir = tmp_path / "run"
    try:
        with trainer_world(rz) as (io_loop, router, _):
            for steps in (2, 3):
                cfg = rl_config(tmp_path)
                cfg.trainer.steps = steps
                cfg.trainer.rl.algorithm = "ppo"
                cfg.trainer.rl.critic.warmup_steps = 1
                cfg.trainer.rl.filter_zero_variance = False  # the fake router's answers are all wrong
                ctx = context(cfg, rz, run_dir)
                rz.connect().set(ctx.keys.router(cfg.router.name), router.url)
                trainer = RLTrainer(ctx, io_loop, Ranks.single(torch.device("cpu")))
                assert trainer.critic is not None and "critic" in trainer.core.companions
                assert trainer.run() == 0
                assert trainer.critic.optimizer.steps == steps  # one mini-batch a step, resumed counts
    finally:
        rz.close()
    tags = ["critic/value_loss", "critic/explained_variance", "critic/grad_norm", "rl/policy_trained", "loss/pg_loss"]
    series = step_series(run_dir, tags, role="trainer")
    assert sorted(series["critic/value_loss"]) == [0, 1, 2]
    assert series["rl/policy_trained"] == {0: 0.0, 1: 1.0, 2: 1.0}
    assert sorted(series["loss/pg_loss"]) == [1, 2]  # the policy's loss only where it trained


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_a_kl_to_the_reference_enters_ppo_as_a_per_token_reward_penalty_or_as_a_loss_term(kl_mode):
    """kl_mode = "reward": kl_coef times the per-token k1 estimate of the policy that begins the step against
    the reference is subtracted from the token rewards before GAE (the advantages' figures equal GAE on the
    penalised rewards, by hand), and the loss has no KL term; "loss": the rewards are the task's and the loss
    carries kl_coef times the aggregated estimate (loss - pg_loss)."""
    from trainer.rl.critic import old_values, ppo_advantages
    from trainer.rl.kl import kl_k1
    from trainer.rl.reference import ReferencePolicy

    cfg = _ppo_config()
    rl = cfg.trainer.rl
    rl.kl_coef, rl.kl_estimator, rl.kl_mode = 0.5, "k1", kl_mode
    cfg.trainer.check()
    batch, rows = _ppo_batch()
    core, critic = _one_rank(cfg)
    _trained_head(critic)
    reference = ReferencePolicy(core.model, core.plan, torch.device("cpu"), torch.float32)
    reference.copy_from(build_model(cfg.trainer.model, seed=5))  # another policy: the KL is far from 0
    mask = batch["mask"]
    sampling = RowSampling(batch["temperature"], batch["top_k"], batch["top_p"])
    with torch.no_grad():
        logp = core.model.eval().token_logprobs(batch["tokens"], batch["targets"], sampling=sampling)
        ref = reference.model.token_logprobs(batch["tokens"], batch["targets"], sampling=sampling)
        values = old_values(critic, batch, rl.micro_batch_samples)
    core.model.train()
    penalty = rl.kl_coef * kl_k1(logp, ref) * mask if kl_mode == "reward" else None
    expected = ppo_advantages(batch["rewards"], values, mask, rl, penalty).figures

    result = ppo_step(core, critic, batch, rows, rl, train_policy=True, reference=reference.model)

    for k in ("rl/advantage_mean", "rl/advantage_std", "critic/return_mean"):
        assert result.figures[k] == pytest.approx(expected[k], rel=1e-6, abs=1e-9), k
    kl_term = result.figures["loss"] - result.figures["pg_loss"]
    assert result.figures["kl_k3"] > 0.01  # k1 may be negative on a sample; k3 never is
    if kl_mode == "reward":
        assert abs(kl_term) < 1e-7
        plain = ppo_advantages(batch["rewards"], values, mask, rl).figures
        assert abs(expected["rl/advantage_mean"] - plain["rl/advantage_mean"]) > 1e-3  # the penalty moved them
    else:
        assert kl_term == pytest.approx(rl.kl_coef * result.figures["kl"], rel=1e-5)


def test_kl_as_a_reward_penalty_is_refused_for_grpo_naming_the_fix():
    with pytest.raises(ConfigError, match='kl_mode = "loss"'):
        load_config(None, ["trainer.rl.kl_coef=0.1", "trainer.rl.kl_mode=reward"])
    load_config(None, ["trainer.rl.kl_coef=0.1", "trainer.rl.kl_mode=reward", "trainer.rl.algorithm=ppo"])

"""The launcher's quiet console (common/runs/console.py): which role lines reach it, how the progress line is
drawn on a terminal and off one, and the figures it reads from a run's real DuckDB metrics."""

from __future__ import annotations

import io
from pathlib import Path

from common.metrics import MetricsWriter
from common.runs.console import MAX_SHOWN_LINES, Console, Figures, Shown, add_live, progress_text, read_figures
from common.runs.dash.sources import LiveState

OURS = "2026-12-03T20:58:26.161Z {level} router demo-1 | {text}"


def test_only_our_warnings_errors_and_tracebacks_reach_the_console(tmp_path):
    shown = Shown(tmp_path / "router-0.log")
    lines = [
        OURS.format(level="INFO   ", text="role up"),
        OURS.format(level="WARNING", text="worker w1 lost"),
        "[vllm w1] WARNING 12-03 21:02:03 [config.py:1] vLLM's own warning",
        "[vllm w1] Traceback (most recent call last):",
        "samples: 10it [00:01]\rsamples: 20it [00:02]" + OURS.format(level="ERROR  ", text="publish failed"),
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: bad",
        "after the traceback",
    ]
    assert [shown(line) for line in lines] == [
        None,
        lines[1],
        None,
        None,
        OURS.format(level="ERROR  ", text="publish failed"),  # without the progress bar before it
        lines[5],
        lines[6],
        "ValueError: bad",
        None,
    ]


def test_a_replica_that_floods_the_console_is_cut_off_once_with_where_the_rest_is(tmp_path):
    shown = Shown(tmp_path / "vllm-0.log")
    out = [shown(OURS.format(level="WARNING", text=f"w{i}")) for i in range(MAX_SHOWN_LINES + 5)]
    assert all(o is not None for o in out[:MAX_SHOWN_LINES])
    assert out[MAX_SHOWN_LINES] == f"... more in {tmp_path / 'vllm-0.log'}"
    assert out[MAX_SHOWN_LINES + 1 :] == [None] * 4


def test_on_a_terminal_the_progress_line_is_redrawn_in_place_below_the_scrolling_lines():
    out = io.StringIO()
    console = Console(out, tty=True)
    console.progress("[0m01s] step 1/5", key="step 1/5")
    console.line("started trainer/0")
    console.progress("[0m02s] step 2/5", key="step 2/5")
    console.finish()
    assert out.getvalue() == (
        "\r\x1b[2K[0m01s] step 1/5\r\x1b[2Kstarted trainer/0\n[0m01s] step 1/5\r\x1b[2K[0m02s] step 2/5\n"
    )


def test_off_a_terminal_a_progress_line_is_printed_when_its_figures_changed_and_not_more_often():
    out = io.StringIO()
    console = Console(out, tty=False, every_s=3600)
    console.progress("[0m01s] step 1/5", key="step 1/5")
    console.progress("[0m03s] step 1/5", key="step 1/5")  # only the clock moved
    console.progress("[0m05s] step 2/5", key="step 2/5")  # changed, but too soon after the last one
    console.line("started trainer/0")
    console.finish()  # the newest figures, once, at the end
    console.finish()
    assert out.getvalue().splitlines() == ["[0m01s] step 1/5", "started trainer/0", "[0m05s] step 2/5"]
    out = io.StringIO()
    console = Console(out, tty=False, every_s=0)
    for step in (1, 1, 2):
        console.progress(f"step {step}", key=f"step {step}")
    console.finish()
    assert out.getvalue().splitlines() == ["step 1", "step 2"]


def test_the_figures_of_an_rl_run_come_from_its_trainer_and_evaluator_metrics(tmp_path):
    run_dir = Path(tmp_path)
    with MetricsWriter(run_dir, "demo", "trainer") as trainer:
        for step in range(120):  # as trainer/rl/driver.py logs it: 0-based
            trainer.log("warmup/loss", step, 5.0 / (step + 1))
        assert read_figures(run_dir, 50, 120).warm_step is None  # nothing flushed yet
        trainer.flush()
        warm = read_figures(run_dir, 50, 120)
        assert (warm.warm_step, warm.loss, warm.step) == (120, 5.0 / 120, None)
        assert progress_text(warm) == "warm start 120/120 | loss 0.04167"
        for step in (0, 1, 2):  # 0-based, as trainer/rl/driver.py logs RL steps
            trainer.log_many(step, {"rl/reward_mean": (4 + step) / 10, "perf/samples_per_s": 101.0 + step})
    with MetricsWriter(run_dir, "demo", "evaluator") as evaluator:
        for version, score in ((0, 0.595), (1, 0.6), (2, 0.71)):
            evaluator.log_many(version, {"eval/arithmetic/accuracy/mean": score, "eval/arithmetic/cases": 200})
    f = read_figures(run_dir, 50, 120)
    assert (f.step, f.reward, f.heldout, f.rate) == (3, 0.6, {"arithmetic": (0, 0.595, 2, 0.71)}, "103 samples/s")
    add_live(
        f,
        LiveState(
            True,
            weights_current=3,
            workers=[
                {"id": "a", "pool": "train", "version": 3, "alive": True},
                {"id": "b", "pool": "train", "version": 1, "alive": False},
                {"id": "c", "pool": "eval", "version": 2, "alive": True},
            ],
        ),
    )
    assert progress_text(f) == (
        "step 3/50 | reward 0.600 | held-out arithmetic 0.710 at v2 (v0: 0.595) | weights v3 (workers: rollout 3; "
        "eval 2) | 103 samples/s"
    )


def test_a_pretraining_run_shows_its_loss_and_tokens_and_a_lost_redis_says_so(tmp_path):
    with MetricsWriter(tmp_path, "pt", "trainer") as trainer:
        trainer.log_many(7, {"train/loss": 2.5, "train/tokens_per_s": 12345.0})
    f = read_figures(tmp_path, 100, 0)
    add_live(f, LiveState(False, "Redis at 127.0.0.1:6379 does not answer (timeout)"))
    assert progress_text(f) == (
        "step 7/100 | loss 2.5 | 12.3k tokens/s | Redis: Redis at 127.0.0.1:6379 does not answer (timeout)"
    )
    assert progress_text(Figures(100, 0)) == "starting"

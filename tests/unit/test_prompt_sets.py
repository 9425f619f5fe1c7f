"""Prompt mixtures (rollout.task.kind = "mixture"): JSONL, parquet and `datasets` sources read alike, a
weighted deterministic interleave, per-source verifiers, the ledger's sources, config errors, and the
demo's second prompt source (configs/data/word_problems.jsonl, written by this module:
`.venv/bin/python -m tests.unit.test_prompt_sets`)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, identity_diff, load_config, render, to_toml
from rollout.flow.runtime import Group
from rollout.tasks import Problem
from rollout.tasks.load import load_task
from rollout.tasks.mixture import MixtureTask, interleave, shuffled_order
from rollout.tasks.sources import RecordKeys, read_problems
from trainer.rl.batch import ledger_record

ROOT = Path(__file__).resolve().parents[2]
WORD_PROBLEMS = ROOT / "configs" / "data" / "word_problems.jsonl"

# The demo's word problems: the demo's arithmetic facts (two operands in 0..6, + or -, configs/demo.toml
# [rollout.task]) phrased with the tiny tokenizer's words (trainer/tinykit.py WORDS), every fact in every
# phrasing of its operator.
_PHRASINGS = {
    "+": [
        "what is {a} plus {b}?",
        "compute {a} plus {b}.",
        "what is the sum of {a} and {b}?",
        "the total of {a} and {b} is",
        "{a} plus {b} equals",
        "solve: {a} plus {b}",
    ],
    "-": [
        "what is {a} minus {b}?",
        "compute {a} minus {b}.",
        "what is the result of {a} minus {b}?",
        "the number {a} minus {b} is",
        "{a} minus {b} equals",
        "solve: {a} minus {b}",
    ],
}


def word_problems() -> list[dict[str, str]]:
    records = []
    for op, phrasings in _PHRASINGS.items():
        for a in range(7):
            for b in range(7):
                answer = a + b if op == "+" else a - b
                records += [{"prompt": p.format(a=a, b=b), "answer": str(answer)} for p in phrasings]
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [{"id": f"q{i}", "question": f"what is {i} plus {i}?", "solution": str(2 * i)} for i in range(40)]
KEYS = RecordKeys(prompt="question", answer="solution")


@pytest.fixture
def prompt_files(tmp_path: Path) -> dict[str, Path]:
    """The same 40 records as JSONL, parquet and a `datasets` save_to_disk directory (real writers)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "qa.jsonl", RECORDS)
    parquet = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    saved = tmp_path / "qa_saved"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(saved))
    return {"jsonl": jsonl, "parquet": parquet, "datasets": saved}


def sources_override(*tables: str) -> str:
    return "rollout.task.sources=[" + ", ".join("{" + t + "}" for t in tables) + "]"


def mixture(*tables: str, extra: tuple[str, ...] = ()) -> MixtureTask:
    cfg = load_config(None, ["rollout.task.kind=mixture", sources_override(*tables), *extra], environ={})
    task = load_task(cfg.rollout.task)
    assert isinstance(task, MixtureTask)
    return task


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_problems(prompt_files):
    read = {fmt: read_problems(path, fmt, KEYS, source="s") for fmt, path in prompt_files.items()}
    assert read["jsonl"] == read["parquet"] == read["datasets"]
    assert read["jsonl"][3] == Problem("s/q3", "what is 3 plus 3?", "6", "s")


def test_numbers_are_answers_and_rows_without_an_id_are_named_by_line(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": 0.5}])
    assert [(p.id, p.answer) for p in read_problems(path, "jsonl")] == [("n-1", "4"), ("n-2", "0.5")]


def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: expected a JSON object with 'prompt' and 'answer'"):
        read_problems(path, "jsonl")
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": [2]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'answer' is \[2\], not a string or a number"):
        read_problems(path, "jsonl")
    # Through the mixture, the error names the source's config key too.
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*set rollout\.task\.sources\[0\]\.prompt_key"):
        mixture(f'name = "b", path = "{path}"')


def test_a_table_without_the_prompt_column_names_the_columns_and_the_key(prompt_files):
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: id, question, solution\); set rollout"):
        read_problems(prompt_files["parquet"], "parquet")


def test_a_saved_dataset_dict_asks_for_one_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"saved DatasetDict \(splits train\); point the path at one split"):
        read_problems(tmp_path / "dd", "datasets", KEYS)


def test_each_source_gets_its_weight_within_2_percent_over_10000_indices(prompt_files):
    keys = 'prompt_key = "question", answer_key = "solution", repeat = true'
    task = mixture(
        'name = "arith", format = "arithmetic", weight = 0.5, num_problems = 50000',
        f'name = "parquet", path = "{prompt_files["parquet"]}", weight = 0.3, {keys}',
        f'name = "saved", path = "{prompt_files["datasets"]}", weight = 0.2, {keys}',
    )
    weights = {"arith": 0.5, "parquet": 0.3, "saved": 0.2}
    sources = [task.problem(i).source for i in range(25_000)]
    for start in (0, 7_777, 15_000):
        counts = Counter(sources[start : start + 10_000])
        for name, w in weights.items():
            assert abs(counts[name] / 10_000 - w) < 0.02, (start, counts)
    # The interleave is smooth at every scale: any 64 consecutive prompts (one demo step) hold
    # 64 * weight of each source up to 1 + m * weight (the module docstring's bound).
    owners = np.array([list(weights).index(s) for s in sources])
    for start in range(0, 25_000 - 64, 101):
        counts = np.bincount(owners[start : start + 64], minlength=3)
        for s, w in enumerate(weights.values()):
            assert abs(counts[s] - 64 * w) <= 1 + 3 * w, (start, counts)


def test_problem_at_an_index_is_the_same_in_two_independently_built_tasks(prompt_files):
    tables = (
        'name = "arith", format = "arithmetic", weight = 0.7, max_value = 6, num_problems = 700',
        f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 0.3, prompt_key = "question", '
        'answer_key = "solution", repeat = true, seed = 5',
    )
    first, second = mixture(*tables), mixture(*tables)
    assert len(first) == len(second) == 1000  # 700 generator problems at 70%: the generator bounds the mixture
    assert [first.problem(i) for i in range(1000)] == [second.problem(i) for i in range(1000)]
    # A resumed cursor reads the same problems out of order too (warm start walks from the end).
    assert [first.problem(i) for i in (999, 3, 500)] == [second.problem(i) for i in (999, 3, 500)]
    reseeded = mixture(tables[0], tables[1].replace("seed = 5", "seed = 6"))
    assert [first.problem(i).id for i in range(100)] != [reseeded.problem(i).id for i in range(100)]


def test_problem_ids_are_prefixed_with_their_source_and_unique(prompt_files):
    task = mixture(
        'name = "arith", format = "arithmetic", weight = 1, num_problems = 60',
        f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 1, prompt_key = "question", answer_key = "solution"',
        f'name = "qb", path = "{prompt_files["parquet"]}", weight = 1, prompt_key = "question", '
        'answer_key = "solution"',
    )
    problems = [task.problem(i) for i in range(len(task))]
    assert all(p.id.startswith(f"{p.source}/") for p in problems)
    assert len({p.id for p in problems}) == len(problems)
    assert {p.id for p in problems if p.source == "qa"} == {f"qa/q{i}" for i in range(40)}


def test_the_mixture_ends_before_a_source_without_repeat_runs_out(prompt_files):
    task = mixture(
        'name = "arith", format = "arithmetic", weight = 0.7, num_problems = 100000',
        f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 0.3, prompt_key = "question", '
        'answer_key = "solution"',
    )
    # 40 rows at 30%: the mixture is about 40 / 0.3 long, and holds each row exactly once.
    assert abs(len(task) - 40 / 0.3) < 1
    rows = [task.problem(i).id for i in range(len(task)) if task.problem(i).source == "qa"]
    assert sorted(rows) == sorted(f"qa/q{i}" for i in range(40))
    with pytest.raises(IndexError, match=rf"outside \[0, {len(task)}\)"):
        task.problem(len(task))


def test_a_repeating_source_visits_every_row_once_per_pass_in_a_new_order(prompt_files):
    task = mixture(
        'name = "arith", format = "arithmetic", weight = 0.5, num_problems = 200',
        f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 0.5, prompt_key = "question", '
        'answer_key = "solution", repeat = true',
    )
    rows = [task.problem(i).id for i in range(len(task)) if task.problem(i).source == "qa"]
    assert len(rows) == 200
    passes = [rows[k : k + 40] for k in range(0, 200, 40)]
    assert all(sorted(p) == sorted(passes[0]) for p in passes)
    assert len({tuple(p) for p in passes}) == 5


def test_shuffled_order_is_a_seeded_permutation():
    orders = {(seed, epoch): tuple(shuffled_order(1000, seed, epoch)) for seed in (0, 1) for epoch in (0, 1)}
    assert all(sorted(o) == list(range(1000)) for o in orders.values())
    assert len(set(orders.values())) == 4
    assert tuple(shuffled_order(1000, 0, 0)) == orders[(0, 0)]


def test_interleave_ranks_each_source_in_order():
    owner, rank = interleave([2.0, 1.0], [10, None])
    assert owner.tolist()[:6] == [0, 1, 0, 0, 1, 0]
    for s in (0, 1):
        assert rank[owner == s].tolist() == list(range(int((owner == s).sum())))
    assert int((owner == 0).sum()) == 10


def test_each_source_rewards_with_its_own_verifier(tmp_path):
    path = write_jsonl(tmp_path / "facts.jsonl", [{"prompt": "what is 12 minus 5?", "answer": "7"}])
    task = mixture(
        'name = "gen", format = "arithmetic", weight = 1, num_problems = 10',
        f'name = "math", path = "{path}", weight = 1, verifier = "math", repeat = true',
        f'name = "first", path = "{path}", weight = 1, verifier = "arithmetic", repeat = true',
        f'name = "exact", path = "{path}", weight = 1, verifier = "exact", repeat = true',
    )
    by_source = {}
    for i in range(len(task)):
        p = task.problem(i)
        by_source.setdefault(p.source, p)
    reward = {name: task.reward(p, "12 minus 5 is 7") for name, p in by_source.items() if name != "gen"}
    assert reward == {"math": 1.0, "first": 0.0, "exact": 0.0}  # last number 7; first integer 12; last line
    assert task.reward(by_source["exact"], "so the answer is\n 7 \n") == 1.0
    assert task.reward(by_source["first"], "7, surely") == 1.0
    gen = by_source["gen"]
    assert task.reward(gen, gen.answer) == 1.0 and task.reward(gen, f"0 {gen.answer}") == float(gen.answer == "0")
    with pytest.raises(ValueError, match=r"names source 'other', which is not in this mixture"):
        task.reward(Problem("x", "p", "1", "other"), "1")


def make_length_verifier(src):
    return lambda problem, completion: float(len(completion) == int(problem.answer))


def test_an_imported_verifier_is_built_from_its_source_config(tmp_path):
    path = write_jsonl(tmp_path / "len.jsonl", [{"prompt": "three letters", "answer": "3"}])
    task = mixture(
        f'name = "len", path = "{path}", verifier = "import", '
        'verifier_import = "tests.unit.test_prompt_sets:make_length_verifier"'
    )
    assert task.reward(task.problem(0), "abc") == 1.0 and task.reward(task.problem(0), "ab") == 0.0


def test_duplicate_ids_in_a_source_are_refused_unless_rows_are_named_by_number(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x", "answer": "1"}] * 2)
    with pytest.raises(ValueError, match=r"problem id 'dup/a' appears twice in .*dup\.jsonl; .*set id_key"):
        mixture(f'name = "dup", path = "{path}"')
    task = mixture(f'name = "dup", path = "{path}", id_key = ""')
    assert sorted(task.problem(i).id for i in range(2)) == ["dup/dup-1", "dup/dup-2"]


def test_the_arithmetic_verifier_refuses_a_source_whose_answers_are_not_integers(tmp_path):
    path = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "half of 1?", "answer": "1/2"}])
    with pytest.raises(ValueError, match=r"'half/half-1' has answer '1/2', not an integer"):
        mixture(f'name = "half", path = "{path}", verifier = "arithmetic"')


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        (
            ['name = "a", path = "/nonexistent/x.jsonl"'],
            r"sources\[0\] \('a'\)\.path '/nonexistent/x\.jsonl' does not exist",
        ),
        (
            ['name = "a", format = "arithmetic", weight = 0'],
            r"sources\[0\] \('a'\)\.weight = 0\.0 must be a number > 0",
        ),
        (['name = "a", format = "arithmetic", weight = -1'], r"\.weight = -1\.0 must be a number > 0"),
        (['name = "a", format = "arithmetic", weight = nan'], r"\.weight = nan must be a number > 0"),
        (
            ['name = "a", format = "arithmetic"', 'name = "a", format = "arithmetic"'],
            r"sources\[1\]\.name = 'a' is used by an earlier source",
        ),
        (
            ['name = "a", format = "arithmetic", verifier = "regex"'],
            r"sources\[0\]\.verifier: 'regex' is not one of 'auto', 'math', 'arithmetic', 'exact', 'import'",
        ),
        (['name = "a", format = "arithmetic", verifier = "import"'], r"needs verifier_import = 'package\.module"),
        (['name = "a/b", format = "arithmetic"'], r"sources\[0\]\.name = 'a/b': give a name of letters"),
        (['name = "a"'], r"sources\[0\] \('a'\) has no path"),
        (['name = "a", format = "arithmetic", path = "x.jsonl"'], r"reads no file: drop path"),
        (['name = "a", format = "arithmetic", repeat = true'], r"does not repeat; raise its num_problems"),
        (['name = "a", format = "arithmetic", operators = "/"'], r"\.operators '/' must be a non-empty subset"),
        (
            ['name = "a", format = "arithmetic", wieght = 1'],
            r"unknown key 'rollout\.task\.sources\[0\]\.wieght': "
            r"did you mean 'weight'\?",
        ),
        ([], r"kind = 'mixture' needs \[\[rollout\.task\.sources\]\]"),
    ],
)
def test_bad_sources_are_refused_naming_the_key_and_the_fix(tables, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.task.kind=mixture", sources_override(*tables)], environ={})


def test_file_checks_name_the_path(prompt_files, tmp_path):
    def load(table: str) -> None:
        load_config(None, ["rollout.task.kind=mixture", sources_override(table)], environ={})

    with pytest.raises(ConfigError, match=r"is a directory, but format 'jsonl' reads a file"):
        load(f'name = "a", path = "{prompt_files["datasets"]}", format = "jsonl"')
    (tmp_path / "qa.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"qa\.csv': cannot tell the format from its name; set format"):
        load(f'name = "a", path = "{tmp_path / "qa.csv"}"')
    with pytest.raises(ConfigError, match=r"every source repeats, so the mixture would never end"):
        load(f'name = "a", path = "{prompt_files["jsonl"]}", repeat = true')
    with pytest.raises(ConfigError, match=r"sources is read only by kind = 'mixture' \(kind is 'arithmetic'\)"):
        load_config(None, [sources_override('name = "a", format = "arithmetic"')], environ={})


def test_the_sources_show_round_trip_and_are_part_of_the_identity(prompt_files):
    table = f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 0.3, prompt_key = "question"'
    cfg = load_config(None, ["rollout.task.kind=mixture", sources_override(table)], environ={})
    shown = render(cfg)
    assert "# Prompt sources of kind = mixture" in shown and 'name = "qa"' in shown and "weight = 0.3" in shown
    assert load_config_text(to_toml(cfg), prompt_files["jsonl"].parent) == cfg
    heavier = load_config(
        None, ["rollout.task.kind=mixture", sources_override(table.replace("0.3", "0.5"))], environ={}
    )
    assert identity_diff(cfg, heavier) == ["rollout.task.sources"]


def load_config_text(text: str, directory: Path):
    path = directory / "config.toml"
    path.write_text(text)
    return load_config(path, environ={})


def test_the_ledger_records_each_prompts_source_aligned_with_its_id(prompt_files):
    task = mixture(
        'name = "arith", format = "arithmetic", weight = 0.7',
        f'name = "qa", path = "{prompt_files["jsonl"]}", weight = 0.3, prompt_key = "question", '
        'answer_key = "solution", repeat = true',
    )
    groups = [Group(i, task.problem(i), []) for i in (4, 5, 6)]
    record = ledger_record(7, groups, task.name)
    assert record == {"step": 7, "prompt_ids": [4, 5, 6], "sources": [task.problem(i).source for i in (4, 5, 6)]}
    assert set(record["sources"]) == {"arith", "qa"}
    single = [Group(0, Problem("arith-0-0", "1+1=", "2"), [])]
    assert ledger_record(0, single, "arithmetic")["sources"] == ["arithmetic"]


# The README's demo mixture: the arithmetic generator (the demo's operands) 70%, the word problems 30%.
DEMO_MIXTURE = [
    "rollout.task.kind=mixture",
    'rollout.task.sources=[{name = "arithmetic", format = "arithmetic", weight = 0.7, max_value = 6}, '
    '{name = "words", path = "configs/data/word_problems.jsonl", weight = 0.3, repeat = true}]',
]


def test_the_demo_runs_with_a_two_source_mixture_as_the_readme_says(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text()
    assert all(f"--set '{o}'" in readme for o in DEMO_MIXTURE), "README's demo mixture differs from DEMO_MIXTURE"
    cfg = load_config(ROOT / "configs" / "demo.toml", DEMO_MIXTURE, environ={})
    task = load_task(cfg.rollout.task)
    problems = [task.problem(i) for i in range(1000)]
    counts = Counter(p.source for p in problems)
    assert counts == {"arithmetic": 700, "words": 300}
    for p in problems:
        assert task.reward(p, p.answer) == 1.0 and task.reward(p, "100") == 0.0
        assert max(int(v) for v in re.findall(r"\d+", p.prompt)) <= 6


def test_the_demo_word_problems_file_is_what_its_generator_writes():
    assert WORD_PROBLEMS.read_text() == "".join(json.dumps(r) + "\n" for r in word_problems())
    assert WORD_PROBLEMS.stat().st_size < 100_000


if __name__ == "__main__":
    write_jsonl(WORD_PROBLEMS, word_problems())
    print(f"wrote {len(word_problems())} problems to {WORD_PROBLEMS.relative_to(ROOT)}")

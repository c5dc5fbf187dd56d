"""Tests of stapo.core.task.data and `stapo prepare`: generator, templates, sources, filters, split, manifest.

Everything runs on small inputs: the arithmetic generator, JSONL files written by the tests, and a
`data.limit`-ed slice of the GSM8K copy shipped with stapo (stapo/evals/data).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from stapo.core.config import ArithmeticData, DataConfig
from stapo.core.task.data import (
    TEMPLATES,
    DataError,
    PromptRecord,
    encode_prompt,
    encode_prompts,
    generate_arithmetic,
    get_template,
    load_prompts,
    normalize_answer,
    prepare_data,
    register_template,
    shipped_data_dir,
)
from stapo.core.trainer.models import build_tiny_tokenizer

SHIPPED = shipped_data_dir()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "knobs",
    [
        {"digits": 1, "num_ops": 1, "ops": ["+"]},
        {"digits": 2, "num_ops": 3, "ops": ["+", "-", "*"]},
        {"digits": 3, "num_ops": 2, "ops": ["-", "*"]},
    ],
)
def test_arithmetic_answers_are_correct(knobs):
    problems = generate_arithmetic(ArithmeticData(num_problems=50, **knobs), seed=3)
    assert len(problems) == 50
    for p in problems:
        m = re.fullmatch(r"What is ([-+* 0-9]+)\?", p.problem)
        assert m, p.problem
        assert len(re.findall(r"[-+*]", m.group(1))) == knobs["num_ops"]
        assert p.answer == str(eval(m.group(1)))  # Python's precedence is the usual one


def test_arithmetic_word_problems():
    one = generate_arithmetic(
        ArithmeticData(num_problems=60, ops=["+", "-", "*"], word_problems=True), seed=0
    )
    for p in one:
        a, b = (int(x) for x in re.findall(r"\d+", p.problem))
        assert int(p.answer) in (a + b, a - b, a * b)
        assert int(p.answer) >= 0  # stories never take away more than there is
    many = generate_arithmetic(
        ArithmeticData(num_problems=30, num_ops=2, digits=2, ops=["+", "-", "*"], word_problems=True), seed=0
    )
    for p in many:
        m = re.fullmatch(
            r"Start with (\d+)\. (\w+)(?: by)? (\d+), then (\w+)(?: by)? (\d+)\. What number do you get\?",
            p.problem,
        )
        assert m, p.problem
        value = int(m.group(1))
        for word, n in ((m.group(2), int(m.group(3))), (m.group(4), int(m.group(5)))):
            value = {"add": value + n, "subtract": value - n, "multiply": value * n}[word.lower()]
        assert p.answer == str(value)  # left to right, as phrased


def test_arithmetic_is_deterministic_and_distinct():
    cfg = ArithmeticData(num_problems=200, digits=2, ops=["+", "*"])
    a, b = generate_arithmetic(cfg, seed=7), generate_arithmetic(cfg, seed=7)
    assert a == b
    assert a != generate_arithmetic(cfg, seed=8)
    assert len({p.problem for p in a}) == 200
    # one-digit addition has only 100 problems: the generator stops there instead of repeating
    assert len(generate_arithmetic(ArithmeticData(num_problems=500), seed=0)) == 100


# ----------------------------------------------------------------------------- templates and encoding


def test_templates_exact_text():
    assert set(TEMPLATES) >= {"dapo", "boxed", "short", "none"}
    assert get_template("dapo")("P") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nP\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert (
        get_template("boxed")("P")
        == "P\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert get_template("short")("P") == "P\nAnswer with only the final number."
    assert get_template("none")("P") == "P"


def test_template_registry_errors():
    with pytest.raises(DataError, match="valid: boxed, dapo, none, short"):
        get_template("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_template("dapo")(lambda p: p)


def test_encode_prompt_with_and_without_chat_template(tok):
    chat = encode_prompt(tok, "1+1", chat_template=True)
    assert tok.decode(chat) == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    assert encode_prompt(tok, "1+1", chat_template=False) == tok("1+1")["input_ids"]
    assert encode_prompts(tok, ["1+1", "22"], chat_template=True, batch_size=1) == [
        chat,
        encode_prompt(tok, "22", chat_template=True),
    ]


def test_normalize_answer():
    assert normalize_answer(" 2,125 ") == "2125"
    assert normalize_answer("1,450,000") == "1450000"
    assert normalize_answer("025") == "25"
    assert normalize_answer("0") == "0"
    assert normalize_answer("$2n-2$") == "2n-2"
    assert normalize_answer("$69$,$84$") == "$69$,$84$"  # several answers: left for the verifier
    assert normalize_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("1,2") == "1,2"  # a tuple, not a thousands separator


# ----------------------------------------------------------------------------- pipeline


def test_default_arithmetic_split_sizes_and_disjoint():
    train, val = load_prompts(DataConfig())
    assert (len(train), len(val)) == (60, 40)  # 100 distinct one-digit sums, 40 held out
    assert not {r.id for r in train} & {r.id for r in val}
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    assert all(r.prompt.endswith("\nAnswer with only the final number.") for r in train + val)
    again = load_prompts(DataConfig())
    assert (train, val) == again
    other_seed = load_prompts(DataConfig(seed=1))
    assert [r.id for r in other_seed[1]] != [r.id for r in val]


def test_limit_caps_train_not_val():
    cfg = DataConfig(val_size=10, limit=5, arithmetic={"num_problems": 300, "digits": 2})
    train, val = load_prompts(cfg)
    assert (len(train), len(val)) == (5, 10)
    assert val == load_prompts(cfg.model_copy(update={"limit": None}))[1]


def test_field_mapping_dedupe_and_answers(tmp_path):
    rows = [
        {"question": "What is 1+1?", "final": 2, "id": "a"},
        {"question": "What is 1+1?", "final": 2, "id": "b"},  # exact duplicate problem: dropped
        {"question": "What is 1000+1125?", "final": "2,125", "id": "c"},
        {"question": "Twice 5?", "final": "10", "id": "d"},
        {"question": "  ", "final": "1", "id": "e"},  # empty problem: dropped
    ]
    path = _write_jsonl(tmp_path / "mine.jsonl", rows)
    cfg = DataConfig(
        source=str(path), problem_field="question", answer_field="final", val_size=1, template="none"
    )
    train, val = load_prompts(cfg)
    got = {r.id: r for r in train + val}
    assert set(got) == {"mine-a", "mine-c", "mine-d"}
    assert got["mine-c"].answer == "2125" and got["mine-a"].answer == "2"
    assert got["mine-d"] == PromptRecord(id="mine-d", prompt="Twice 5?", answer="10", source="mine")


def test_missing_field_names_the_config_field(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(
        DataError, match=r"data.problem_field: field 'problem' not found .* fields present: answer, question"
    ):
        load_prompts(DataConfig(source=str(path)))


def test_english_only_drops_cjk(tmp_path):
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(4)] + [
        {"problem": "求 1+1 的值", "answer": "2"}
    ]
    path = _write_jsonl(tmp_path / "mix.jsonl", rows)
    all_train, all_val = load_prompts(DataConfig(source=str(path), val_size=1))
    en_train, en_val = load_prompts(DataConfig(source=str(path), val_size=1, english_only=True))
    assert len(all_train + all_val) == 5 and len(en_train + en_val) == 4
    assert not any("求" in r.prompt for r in en_train + en_val)


def test_length_filter_with_tiny_tokenizer(tmp_path, tok):
    # the chat template wraps the user message in 19 tokens: 3 specials + 16 characters
    overhead = len(encode_prompt(tok, "", chat_template=True))
    assert overhead == 3 + len("user\n\nassistant\n") == 19
    rows = [{"problem": "x" * n, "answer": "1"} for n in (5, 10, 20, 40)]
    path = _write_jsonl(tmp_path / "len.jsonl", rows)
    cfg = DataConfig(source=str(path), template="none", val_size=0, max_prompt_tokens=overhead + 20)
    train, _ = load_prompts(cfg, tok)
    assert sorted(len(r.prompt) for r in train) == [5, 10, 20]  # 40 chars is over the limit
    no_chat, _ = load_prompts(cfg.model_copy(update={"chat_template": False, "max_prompt_tokens": 10}), tok)
    assert sorted(len(r.prompt) for r in no_chat) == [5, 10]
    assert len(load_prompts(cfg)[0]) == 4  # no tokenizer: no length filter


def test_val_size_too_large_is_an_error(tmp_path):
    path = _write_jsonl(
        tmp_path / "tiny.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}]
    )
    with pytest.raises(DataError, match="data.val_size=2 leaves no training prompts"):
        load_prompts(DataConfig(source=str(path), val_size=2))


@pytest.mark.parametrize(
    "source,match",
    [
        ("no_such_set", "unknown source 'no_such_set'; valid: arithmetic, dapo_math_17k, gsm8k"),
        ("data.csv", "unknown source"),
    ],
)
def test_bad_source_is_a_clear_error(source, match):
    with pytest.raises(DataError, match=match):
        load_prompts(DataConfig(source=source))


def test_bad_local_files(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        load_prompts(DataConfig(source=str(tmp_path / "d.csv")))
    (tmp_path / "bad.jsonl").write_text('{"problem": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompts(DataConfig(source=str(tmp_path / "bad.jsonl")))
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="without manifest.json"):
        load_prompts(DataConfig(source=str(tmp_path / "folder")))
    with pytest.raises(DataError, match="data.data_dir"):
        load_prompts(DataConfig(source="gsm8k", data_dir=str(tmp_path / "nowhere")))


def test_parquet_reads_or_says_pyarrow_is_missing(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match="needs pyarrow"):
            load_prompts(DataConfig(source=str(tmp_path / "d.parquet")))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"problem": ["a", "b", "c"], "answer": ["1", "2", "3"]}), tmp_path / "d.parquet"
        )
        train, val = load_prompts(DataConfig(source=str(tmp_path / "d.parquet"), val_size=1))
        assert len(train) + len(val) == 3


def test_hf_source_without_datasets_says_so():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="needs the `datasets` package"):
            load_prompts(DataConfig(source="hf:openai/gsm8k:main@test"))
    else:
        pytest.skip("datasets installed; the hub path is not exercised offline")


def test_hf_source_parses_id_config_split_and_maps_fields(monkeypatch):
    """The hub path with a stand-in `datasets` module (no network): arguments and field mapping."""
    import sys
    import types

    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "down/set":
            raise ConnectionError("no route to host")
        return [{"question": f"q{i}", "final": i} for i in range(6)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = DataConfig(
        source="hf:openai/gsm8k:main@test", problem_field="question", answer_field="final", val_size=2
    )
    train, val = load_prompts(cfg)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert len(train) == 4 and {r.source for r in train} == {"openai/gsm8k"}
    assert sorted(r.answer for r in train + val) == ["0", "1", "2", "3", "4", "5"]
    load_prompts(cfg.model_copy(update={"source": "hf:some/set"}))
    assert calls[-1] == ("some/set", None, "train")
    with pytest.raises(DataError, match="Is the hub reachable"):
        load_prompts(cfg.model_copy(update={"source": "hf:down/set"}))


def test_gsm8k_slice_from_shipped_data(tok, monkeypatch):
    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)
    cfg = DataConfig(source="gsm8k", template="boxed", val_size=5, limit=20)  # no data_dir: shipped copy
    train, val = load_prompts(cfg, tok)
    assert (len(train), len(val)) == (20, 5)
    assert all(r.source == "gsm8k" and r.id.startswith("gsm8k-") for r in train + val)
    assert all(r.prompt.endswith("within \\boxed{}.") for r in train)
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r.answer) for r in train + val)  # commas stripped
    # the first GSM8K test problem, wherever it landed, keeps its text and answer
    first = json.loads((SHIPPED / "gsm8k_test.jsonl").open().readline())
    full_train, full_val = load_prompts(cfg.model_copy(update={"limit": None}))
    rec = next(r for r in full_train + full_val if r.id == "gsm8k-0")
    assert rec.prompt.startswith(first["problem"]) and rec.answer == first["answer"] == "18"
    assert len(full_train) + len(full_val) == 1319


def test_default_data_dir_is_the_shipped_copy_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing here: the copy inside the installed package is read
    train, val = load_prompts(DataConfig(source="aime24", val_size=5))
    assert len(train) + len(val) == 30
    assert {r.answer for r in train + val} >= {"25"}  # "025" zero padding undone


def test_data_dir_order_setting_then_env_then_shipped(monkeypatch, tmp_path):
    """data.data_dir beats $STAPO_DATA_DIR, which beats the shipped copy; a named folder is used alone."""
    env_dir, cfg_dir = tmp_path / "env", tmp_path / "cfg"
    for d, answer in ((env_dir, "111"), (cfg_dir, "222")):
        d.mkdir()
        _write_jsonl(d / "aime24.jsonl", [{"id": i, "problem": f"p{i} {d.name}", "answer": answer} for i in range(4)])
    monkeypatch.setenv("STAPO_DATA_DIR", str(env_dir))
    train, val = load_prompts(DataConfig(source="aime24", val_size=1))
    assert {r.answer for r in train + val} == {"111"}
    train, val = load_prompts(DataConfig(source="aime24", val_size=1, data_dir=str(cfg_dir)))
    assert {r.answer for r in train + val} == {"222"}
    monkeypatch.chdir(tmp_path)  # a relative data_dir is relative to the working directory
    train, _ = load_prompts(DataConfig(source="aime24", val_size=1, data_dir="cfg"))
    assert {r.answer for r in train} == {"222"}
    with pytest.raises(DataError, match=r"data.data_dir .*gsm8k_test.jsonl"):  # no silent fallback
        load_prompts(DataConfig(source="gsm8k", val_size=1))
    monkeypatch.delenv("STAPO_DATA_DIR")
    train, val = load_prompts(DataConfig(source="aime24", val_size=5))
    assert len(train) + len(val) == 30


# ----------------------------------------------------------------------------- prepare


def test_prepare_writes_manifest_and_round_trips(tmp_path, tok):
    cfg = DataConfig(
        val_size=10, limit=30, arithmetic={"num_problems": 80, "digits": 2}, max_prompt_tokens=100
    )
    out = prepare_data(cfg, tmp_path / "prep", tok)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train.jsonl", "val.jsonl"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"] == "arithmetic" and m["template"] == "short" and m["seed"] == 0
    assert m["tokenizer"] == "tiny-random" and m["max_prompt_tokens"] == 100
    assert m["counts"] == {
        "loaded": 80,
        "after_empty_filter": 80,
        "after_dedupe": 80,
        "after_english_only": 80,
        "after_length_filter": 80,
        "train": 30,
        "val": 10,
    }
    for name in ("train.jsonl", "val.jsonl"):
        data = (out / name).read_bytes()
        assert m["files"][name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert m["files"][name]["rows"] == data.count(b"\n")
        assert set(json.loads(data.splitlines()[0])) == {"id", "prompt", "answer", "source"}
    assert m["created"] and m["data_config"]["arithmetic"]["digits"] == 2

    train, val = load_prompts(cfg)
    # a prepared dir reads back as written, without re-templating ("short" would double the suffix)
    back_train, back_val = load_prompts(DataConfig(source=str(out), template="short", val_size=10))
    assert (back_train, back_val) == (train, val)
    assert load_prompts(DataConfig(source=str(out), val_size=3, limit=4)) == (train[:4], val[:3])


def test_prepare_replaces_only_prepared_dirs(tmp_path):
    cfg = DataConfig(val_size=5, arithmetic={"num_problems": 20})
    out = prepare_data(cfg, tmp_path / "p")
    first = (out / "val.jsonl").read_text()
    prepare_data(cfg.model_copy(update={"seed": 1}), out)  # an earlier prepared dir is replaced
    assert (out / "val.jsonl").read_text() != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared data dir"):
        prepare_data(cfg, tmp_path / "other")
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"


def test_cli_prepare_writes_files(tmp_path):
    from typer.testing import CliRunner

    from stapo.cli.main import app

    src = _write_jsonl(
        tmp_path / "src.jsonl", [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(12)]
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "prepare",
            "--source",
            str(src),
            "--template",
            "dapo",
            "--set",
            "data.problem_field=q",
            "--set",
            "data.answer_field=a",
            "--set",
            "data.val_size=2",
            "--tokenizer",
            "tiny-random",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["template"] == "dapo" and m["counts"]["train"] == 10 and m["counts"]["val"] == 2
    assert m["tokenizer"] == "tiny-random"
    row = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    assert row["prompt"].startswith("Solve the following math problem") and row["source"] == "src"
    assert "train.jsonl" in result.output


def test_cli_prepare_bad_source_and_bad_set(tmp_path):
    from typer.testing import CliRunner

    from stapo.cli.common import CLIError
    from stapo.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["prepare", "--source", "nope", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, CLIError)
    assert "unknown source 'nope'" in str(result.exception)
    result = runner.invoke(app, ["prepare", "--set", "data.nope=1", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, CLIError) and "unknown field 'nope'" in str(result.exception)
    result = runner.invoke(app, ["prepare", "--template", "fancy", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, CLIError) and "data.template" in str(result.exception)
    assert not (tmp_path / "o").exists()


def test_cli_prepare_dapo_math_17k_from_the_shipped_copy(tmp_path, monkeypatch):
    """The recipes' data step from a clone: a positional source, no data flag, --out defaulted."""
    from typer.testing import CliRunner

    from stapo.cli.main import app

    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    args = ["prepare", "dapo_math_17k", "--template", "dapo", "--set", "data.english_only=true",
            "--set", "data.val_size=100"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "prepared" / "dapo_math_17k" / "manifest.json").read_text())
    assert m["origin"] == str(SHIPPED / "dapo_math_17k.jsonl")
    # counts from evals/data/README.md: 17917 rows, 17255 distinct problems, 3232 of them with CJK
    assert m["counts"]["loaded"] == 17917 and m["counts"]["after_dedupe"] == 17255
    assert m["counts"]["after_english_only"] == 14023
    assert (m["counts"]["train"], m["counts"]["val"]) == (13923, 100)
    row = json.loads((tmp_path / "prepared" / "dapo_math_17k" / "val.jsonl").open().readline())
    assert row["prompt"].startswith("Solve the following math problem") and row["id"].startswith("dapo_math_17k-")
    result = CliRunner().invoke(app, ["prepare", "gsm8k", "--source", "math500"])
    assert "disagree" in str(result.exception)


# ----------------------------------------------------------------------------- DAPO-Math-17k from the hub

# The original prompt template, as written in evals/data/README.md (not taken from the code under test).
HUB_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
HUB_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
HUB_CN = (
    "\n让我们一步一步地思考。请以“Answer: \\boxed{<final_answer>}”的格式输出最终答案。如果是选择题，请按顺序输出正确的"
    "选项，不带任何标点或空格。对于其他类型的问题，请只输出最终答案的数值。"
)
CN_IDS = {5546, 5552, 5556, 5557, 5560, 5564, 5570, 5571, 5573, 5578, 5579, 5583, 5584, 5588, 5589, 5591,
          5595, 5600, 5608, 5610}  # README: the rows that carried HUB_CN


def _hub_rows(shipped: list[dict], copies: int = 2) -> list[dict]:
    """Rows in the hub's shape (verl parquet schema), each prompt repeated ``copies`` times as on the hub.

    Texts that repeat in the shipped file differ in the original prompt (README: near-duplicates), so
    the k-th repeat gets k trailing newlines inside the prompt, which the conversion trims away.
    """
    seen: dict[str, int] = {}
    once = []
    for r in shipped:
        k = seen.get(r["problem"], 0)
        seen[r["problem"]] = k + 1
        body = r["problem"] + "\n" * k + (HUB_CN if int(r["id"]) in CN_IDS else "")
        once.append({
            "data_source": "math_dapo", "ability": "MATH",
            "prompt": [{"role": "user", "content": HUB_PREFIX + body + HUB_SUFFIX}],
            "reward_model": {"ground_truth": r["answer"], "style": "rule-lean"},
            "extra_info": {"index": f"uuid-{r['id']}"},
        })
    return once * copies


def _shipped_dapo() -> list[dict]:
    return [json.loads(line) for line in (SHIPPED / "dapo_math_17k.jsonl").open(encoding="utf-8")]


def test_dapo_hub_conversion_on_a_small_file(tmp_path):
    from stapo.core.task.data import convert_dapo_hub_rows, rebuild_dapo_math_17k

    shipped = _shipped_dapo()
    picked = shipped[:5] + [shipped[5546], shipped[35], shipped[179]]  # a CN row; 35/179: near-duplicates
    hub = _hub_rows(picked, copies=3)
    hub.insert(2, dict(hub[0]))  # an exact repeat early on: first occurrence wins, order kept
    src = _write_jsonl(tmp_path / "hub.jsonl", hub)
    rows = convert_dapo_hub_rows(hub)
    assert [(r["problem"], r["answer"]) for r in rows] == [(r["problem"], r["answer"]) for r in picked]
    assert [r["id"] for r in rows] == [str(i) for i in range(len(picked))]
    assert "让我们" not in rows[5]["problem"] and rows[5]["problem"] == shipped[5546]["problem"]
    with pytest.raises(DataError, match="differs from the shipped copy"):  # a part is not the whole set
        rebuild_dapo_math_17k(tmp_path / "out", source=src)
    assert not (tmp_path / "out" / "dapo_math_17k.jsonl").exists()
    path, n, _ = rebuild_dapo_math_17k(tmp_path / "out", source=src, verify=False)
    assert n == len(picked) and [json.loads(x)["problem"] for x in path.open()] == [r["problem"] for r in picked]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [hub[0], {"prompt": "x", "reward_model": {}}])
    with pytest.raises(DataError, match="bad.jsonl row 1: not in the hub's DAPO-Math-17k format"):
        rebuild_dapo_math_17k(tmp_path / "out", source=bad)


def test_dapo_rebuild_from_a_full_hub_file_matches_the_shipped_copy(tmp_path, monkeypatch):
    """The whole set in the hub's shape (every prompt twice) rebuilds to the shipped rows: checksum passes."""
    from typer.testing import CliRunner

    from stapo.cli.main import app

    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)
    src = _write_jsonl(tmp_path / "dapo-math-17k.jsonl", _hub_rows(_shipped_dapo(), copies=2))
    res = CliRunner().invoke(app, ["prepare", "dapo_math_17k", "--rebuild", "--from", str(src),
                                   "--out", str(tmp_path / "cache")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "17917 rows" in res.output and "matches the shipped copy" in res.output
    rebuilt = tmp_path / "cache" / "dapo_math_17k.jsonl"
    cfg = DataConfig(source="dapo_math_17k", val_size=50)
    assert load_prompts(cfg.model_copy(update={"source": str(rebuilt)})) == load_prompts(cfg)


def test_dapo_rebuild_offline_says_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub

    from stapo.core.task.data import rebuild_dapo_math_17k

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)  # stands in for a hub that cannot be reached
    with pytest.raises(DataError, match=r"could not download BytedTsinghua-SIA/DAPO-Math-17k.*--from FILE"):
        rebuild_dapo_math_17k(tmp_path)

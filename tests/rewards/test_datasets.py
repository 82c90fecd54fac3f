"""Loading JSON Lines prompt files: good records, and errors that name the file and the line."""

from __future__ import annotations

import re

import pytest

from megatron_rl.rewards import (
    DataConfig,
    DatasetError,
    Problem,
    load_jsonl_problems,
    load_parquet_problems,
    problem_source,
)


def _write(tmp_path, text: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_loads_records_skipping_blank_lines(tmp_path):
    path = _write(
        tmp_path,
        '{"prompt": "What is 6*7?", "answer": 42, "source": "quiz"}\n'
        "\n"
        '{"prompt": "Half of 1?", "answer": 0.5}\n'
        "   \n"
        '{"prompt": "Capital of France?", "answer": "Paris"}',
    )
    problems = load_jsonl_problems(path)
    assert problems == [
        Problem(prompt="What is 6*7?", solution="", reference="42"),
        Problem(prompt="Half of 1?", solution="", reference="0.5"),
        Problem(prompt="Capital of France?", solution="", reference="Paris"),
    ]
    # each knows its line, for the errors that come later (a prompt the tokenizer cannot encode)
    assert [problem.origin for problem in problems] == [f"{path}:1", f"{path}:3", f"{path}:5"]


def test_custom_keys_and_a_string_path(tmp_path):
    path = _write(tmp_path, '{"question": "1+1?", "solution": "2"}\n')
    problems = load_jsonl_problems(str(path), prompt_key="question", answer_key="solution")
    assert problems == [Problem(prompt="1+1?", solution="", reference="2")]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', 2, "not valid JSON"),
        ('\n\n["prompt", "answer"]\n', 3, "expected a JSON object, got list"),
        ('{"prompt": "a", "answer": "1"}\n"text"\n', 2, "expected a JSON object, got str"),
        (
            '{"question": "a", "answer": "1"}\n',
            1,
            "missing key 'prompt'; keys present: 'question', 'answer'",
        ),
        ('{"prompt": "a"}\n', 1, "missing key 'answer'; keys present: 'prompt'"),
        ("{}\n", 1, "missing key 'prompt'; keys present: none"),
        ('{"prompt": "", "answer": "1"}\n', 1, "'prompt': expected a non-empty string"),
        ('{"prompt": 3, "answer": "1"}\n', 1, "'prompt': expected a non-empty string"),
        ('{"prompt": "a", "answer": null}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": true}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": [1]}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": NaN}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": " "}\n', 1, "'answer': expected a non-empty string or a"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, text, line, message):
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:{line}: ") + ".*" + message):
        load_jsonl_problems(path)


def test_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: expected UTF-8")):
        load_jsonl_problems(path)


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DatasetError, match=re.escape(f"{path}: file not found")):
        load_jsonl_problems(path)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_file_without_records_is_named(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: no records")):
        load_jsonl_problems(path)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)


def _write_parquet(path, columns: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_rows_load_through_hugging_face_datasets(tmp_path):
    path = _write_parquet(
        tmp_path / "train.parquet",
        {
            "question": ["What is 6*7?", "Half of 1?"],
            "solution": ["42", "\\frac{1}{2}"],
            "x": [1, 2],
        },
    )
    problems = load_parquet_problems(path, prompt_key="question", answer_key="solution")
    assert problems == [
        Problem(prompt="What is 6*7?", solution="", reference="42"),
        Problem(prompt="Half of 1?", solution="", reference="\\frac{1}{2}"),
    ]
    assert [problem.origin for problem in problems] == [f"{path}: row 0", f"{path}: row 1"]
    numbers = _write_parquet(tmp_path / "n.parquet", {"prompt": ["a", "b"], "answer": [42, 7]})
    assert [p.reference for p in load_parquet_problems(numbers)] == ["42", "7"]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (
            {"prompt": ["a"], "reply": ["1"]},
            "no column 'answer'; columns present: 'prompt', 'reply'",
        ),
        (
            {"prompt": ["a", ""], "answer": ["1", "2"]},
            "row 1: 'prompt': expected a non-empty string",
        ),
        ({"prompt": ["a", "b"], "answer": ["1", None]}, "row 1: 'answer': expected a non-empty"),
        ({"prompt": [], "answer": []}, "no rows"),
    ],
)
def test_bad_parquet_names_the_file_row_and_column(tmp_path, columns, message):
    import pyarrow as pa

    if not columns["prompt"]:
        columns = {name: pa.array([], type=pa.string()) for name in columns}
    path = _write_parquet(tmp_path / "bad.parquet", columns)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: {message}")):
        load_parquet_problems(path)


def test_a_file_that_is_not_parquet_or_absent_is_named(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}: not readable as parquet")):
        load_parquet_problems(path)
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'no.parquet'}: file not found")):
        load_parquet_problems(tmp_path / "no.parquet")


def test_the_data_section_reads_either_format_with_its_keys(tmp_path):
    jsonl = _write(tmp_path, '{"q": "1+1?", "a": 2}\n{"q": "2+2?", "a": 4}\n')
    parquet = _write_parquet(tmp_path / "p.parquet", {"q": ["1+1?", "2+2?"], "a": ["2", "4"]})
    for source, path in (("jsonl", jsonl), ("parquet", parquet)):
        config = DataConfig(
            source=source, train_path=str(path), eval_path=str(path), prompt_key="q", answer_key="a"
        )
        config.validate()
        problems = problem_source(config, per_step=2, seed=0)
        assert sorted(p.reference for p in problems.train_batch(1)) == ["2", "4"]
        assert [p.prompt for p in problems.eval_problems] == ["1+1?", "2+2?"]

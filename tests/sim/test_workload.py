from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from lumend.sim.workload import TraceError, Workload, read_trace, synthetic


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_reads_splitwise_format_with_extra_columns_and_sorts(tmp_path: Path) -> None:
    path = write(tmp_path, ",arrived_at,num_prefill_tokens,num_decode_tokens\n"
                 "0,1.5,100,10\n1,0.25,200,20\n\n")
    w = read_trace(path)
    assert w.arrivals == [0.25, 1.5]
    assert w.prompts == [200, 100]
    assert w.outputs == [20, 10]


@pytest.mark.parametrize(("body", "line", "column", "fragment"), [
    ("0.0,10,5\n1.0,abc,5\n", 3, 2, "'abc' is not an integer"),
    ("0.0,10,5\nsoon,10,5\n", 3, 1, "'soon' is not a number"),
    ("0.0,10\n", 2, 3, "missing"),
    ("0.0,10,0\n", 2, 3, "must be >= 1 token"),
    ("-1,10,5\n", 2, 1, "must be >= 0"),
])
def test_malformed_values_name_line_and_column(
    tmp_path: Path, body: str, line: int, column: int, fragment: str
) -> None:
    path = write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n" + body)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == line and info.value.column == column
    assert str(info.value).startswith(f"{path}:{line}: column {column} (")
    assert fragment in str(info.value)


AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_reads_the_azure_trace_as_published(tmp_path: Path) -> None:
    # The published files' first lines (AzurePublicDataset, 2023 conversation trace):
    # 7-digit fractions of a second, unsorted here; arrivals count from the earliest.
    path = write(tmp_path, AZURE + "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:16:01.0000000,879,0\n")
    w = read_trace(path)
    assert w.arrivals == [0.0, pytest.approx(4.314579), pytest.approx(14.31941)]
    assert w.prompts == [374, 396, 879]
    assert w.outputs == [44, 109, 1]  # 0 generated tokens: still one first token
    # Time zones are honoured: the same instants written in +01:00 give the same arrivals.
    shifted = write(tmp_path, AZURE + "2023-11-16T19:15:46.68059+01:00,374,44\n"
                    "2023-11-16T18:15:50.995169Z,396,109\n")
    assert read_trace(shifted).arrivals == [0.0, pytest.approx(4.314579)]


@pytest.mark.parametrize(("body", "line", "column", "fragment"), [
    ("2023-11-16 18:15:46,10,5\nyesterday,10,5\n", 3, 1, "'yesterday' is not a datetime"),
    ("2023-11-16 18:15:46,ten,5\n", 2, 2, "'ten' is not an integer"),
    ("2023-11-16 18:15:46,0,5\n", 2, 2, "must be >= 1 token"),
    ("2023-11-16 18:15:46,10,-3\n", 2, 3, "must be >= 0 tokens"),
    ("2023-11-16 18:15:46,10\n", 2, 3, "missing"),
])
def test_malformed_azure_rows_name_line_and_column(
    tmp_path: Path, body: str, line: int, column: int, fragment: str
) -> None:
    path = write(tmp_path, AZURE + body)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == line and info.value.column == column
    assert str(info.value).startswith(f"{path}:{line}: column {column} (")
    assert fragment in str(info.value)


def test_bad_header_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r":1: header lacks num_decode_tokens"):
        read_trace(write(tmp_path, "arrived_at,num_prefill_tokens\n1,2\n"))
    with pytest.raises(TraceError, match=r":1: header lacks GeneratedTokens.*Azure"):
        read_trace(write(tmp_path, "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,2\n"))
    with pytest.raises(TraceError, match="empty file"):
        read_trace(write(tmp_path, ""))
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "absent.csv")


def test_scaling_hits_target_rate_and_keeps_requests() -> None:
    w = Workload([10.0, 11.0, 13.0, 14.0], [1, 2, 3, 4], [5, 6, 7, 8])
    scaled = w.scaled_to_rate(6.0)
    assert scaled.rate() == pytest.approx(6.0)
    assert scaled.arrivals[0] == 0.0 and scaled.prompts == w.prompts
    assert scaled.arrivals == [0.0, 0.125, 0.375, 0.5]
    assert len(scaled.truncated(0.3)) == 2


def test_synthetic_matches_published_shape_and_is_seeded() -> None:
    w = synthetic(rate=20.0, duration_s=1000.0, seed=7)
    assert w.rate() == pytest.approx(20.0, rel=0.05)
    prompts, outputs = sorted(w.prompts), sorted(w.outputs)
    n = len(prompts)
    assert statistics.mean(prompts) == pytest.approx(1155, rel=0.05)
    assert prompts[n // 2] == pytest.approx(1020, rel=0.05)
    assert prompts[int(0.9 * n)] == pytest.approx(2735, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(211, rel=0.05)
    assert outputs[n // 2] == pytest.approx(129, rel=0.08)
    assert outputs[int(0.9 * n)] == pytest.approx(424, rel=0.05)
    gaps = [b - a for a, b in zip(w.arrivals, w.arrivals[1:], strict=False)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.1, rel=0.1)
    assert synthetic(20.0, 100.0, seed=7) == synthetic(20.0, 100.0, seed=7)
    assert synthetic(20.0, 100.0, seed=8) != synthetic(20.0, 100.0, seed=7)

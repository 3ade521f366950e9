"""Workloads: CSV trace replay, time scaling, and a synthetic conversation-trace generator.

A workload is three parallel lists sorted by arrival time. Trace files are CSV with a header
and one request per line (other columns are ignored), in either of two formats, told apart by
the header:

* the Azure LLM inference trace as published (Azure/AzurePublicDataset, used by Splitwise):
  `TIMESTAMP` (a datetime such as `2023-11-16 18:15:46.6805900`; arrivals are measured from
  the earliest), `ContextTokens` (prompt) and `GeneratedTokens` (output; 0 is read as 1: a
  request produces at least its first token);
* Vidur's processed form of it: `arrived_at` (seconds), `num_prefill_tokens`,
  `num_decode_tokens`.
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")  # Vidur
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")  # as published
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class TraceError(ValueError):
    """A malformed trace; the message names the file, line and column."""

    def __init__(self, path: Path | str, line: int, column: int | None, message: str,
                 name: str | None = None) -> None:
        where = f"{path}:{line}"
        if column is not None:
            where += f": column {column}" + (f" ({name})" if name else "")
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.column = str(path), line, column


@dataclass(frozen=True, slots=True)
class Workload:
    arrivals: list[float]  # seconds, non-decreasing
    prompts: list[int]     # prompt tokens, >= 1
    outputs: list[int]     # output tokens, >= 1

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration_s(self) -> float:
        return self.arrivals[-1] - self.arrivals[0] if self.arrivals else 0.0

    def rate(self) -> float:
        """Requests per second over the span of arrivals."""
        span = self.duration_s
        return (len(self) - 1) / span if span > 0 else 0.0

    def scaled_to_rate(self, rate: float) -> Workload:
        """The same requests with inter-arrival times scaled so the mean rate is `rate`."""
        if rate <= 0:
            raise ValueError(f"target rate must be positive, got {rate}")
        current = self.rate()
        if current == 0:
            return self
        factor = current / rate
        t0 = self.arrivals[0]
        return Workload([(t - t0) * factor for t in self.arrivals], self.prompts, self.outputs)

    def truncated(self, duration_s: float) -> Workload:
        """Requests arriving before `duration_s` (measured from the first arrival)."""
        if not self.arrivals:
            return self
        end = bisect.bisect_left(self.arrivals, self.arrivals[0] + duration_s)
        return Workload(self.arrivals[:end], self.prompts[:end], self.outputs[:end])


def read_trace(path: Path) -> Workload:
    """Parse a trace CSV; raise TraceError naming line and column on any bad value."""
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(path, 0, None, f"cannot open: {exc.strerror}") from exc
    rows: list[tuple[float, int, int]] = []
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(path, 1, None, "empty file; expected a header "
                             + ",".join(COLUMNS)) from None
        except csv.Error as exc:
            raise TraceError(path, 1, None, str(exc)) from None
        names = [h.strip().lstrip("\ufeff") for h in header]
        columns = AZURE_COLUMNS if AZURE_COLUMNS[0] in names else COLUMNS
        missing = [c for c in columns if c not in names]
        if missing:
            raise TraceError(path, 1, None, f"header lacks {', '.join(missing)}; expected "
                             f"columns {', '.join(COLUMNS)} (Vidur) or "
                             f"{', '.join(AZURE_COLUMNS)} (Azure, as published) "
                             f"(got {', '.join(names) or 'none'})")
        index = [names.index(c) for c in columns]
        parse = _parse_azure_row if columns is AZURE_COLUMNS else _parse_row
        try:
            for fields in reader:
                line = reader.line_num
                if not fields or all(not f.strip() for f in fields):
                    continue
                rows.append(parse(path, line, fields, index))
        except csv.Error as exc:
            raise TraceError(path, reader.line_num, None, str(exc)) from None
    if not rows:
        raise TraceError(path, 2, None, "no requests after the header")
    rows.sort(key=lambda r: r[0])
    if columns is AZURE_COLUMNS:  # microseconds since the epoch (exact in a float)
        t0 = rows[0][0]
        arrivals = [(r[0] - t0) / 1e6 for r in rows]
    else:
        arrivals = [r[0] for r in rows]
    return Workload(arrivals, [r[1] for r in rows], [r[2] for r in rows])


def _field(path: Path, line: int, fields: list[str], col: int, name: str) -> str:
    if col >= len(fields):
        raise TraceError(path, line, col + 1, f"missing: the line has only {len(fields)} "
                         "field(s)", name)
    return fields[col].strip()


def _tokens(path: Path, line: int, text: str, col: int, name: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, col + 1, f"{text!r} is not an integer", name) from None
    if value < least:
        raise TraceError(path, line, col + 1, f"{text!r} must be >= {least} token"
                         + ("s" if least != 1 else ""), name)
    return value


def _parse_azure_row(
    path: Path, line: int, fields: list[str], index: list[int]
) -> tuple[float, int, int]:
    """A row of the published Azure trace: (microseconds since the epoch, prompt, output
    tokens)."""
    (tcol, pcol, ocol), (tname, pname, oname) = index, AZURE_COLUMNS
    text = _field(path, line, fields, tcol, tname)
    try:
        stamp = _datetime(text)
    except ValueError:
        raise TraceError(path, line, tcol + 1, f"{text!r} is not a datetime (e.g. "
                         "2023-11-16 18:15:46.6805900)", tname) from None
    prompt = _tokens(path, line, _field(path, line, fields, pcol, pname), pcol, pname, 1)
    output = _tokens(path, line, _field(path, line, fields, ocol, oname), ocol, oname, 0)
    return stamp, prompt, max(1, output)


def _datetime(text: str) -> float:
    """Microseconds since the epoch of an ISO datetime; naive ones are UTC. Fractions
    beyond microseconds (the published trace has 7 digits) are cut to 6 for Python 3.11."""
    date, sep, frac = text.partition(".")
    if sep:
        digits = len(frac) - len(frac.lstrip("0123456789"))
        if digits > 6:
            frac = frac[:6] + frac[digits:]
        text = f"{date}.{frac}"
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return float((parsed - EPOCH) // timedelta(microseconds=1))


def _parse_row(
    path: Path, line: int, fields: list[str], index: list[int]
) -> tuple[float, int, int]:
    values: list[float] = []
    for name, col in zip(COLUMNS, index, strict=True):
        column = col + 1
        if col >= len(fields):
            raise TraceError(path, line, column, f"missing: the line has only "
                             f"{len(fields)} field(s)", name)
        text = fields[col].strip()
        try:
            value = float(text) if name == "arrived_at" else int(text)
        except ValueError:
            kind = "a number" if name == "arrived_at" else "an integer"
            raise TraceError(path, line, column, f"{text!r} is not {kind}", name) from None
        if not math.isfinite(value) or value < 0:
            raise TraceError(path, line, column, f"{text!r} must be >= 0", name)
        if name != "arrived_at" and value < 1:
            raise TraceError(path, line, column, f"{text!r} must be >= 1 token", name)
        values.append(value)
    return values[0], int(values[1]), int(values[2])


# -- synthetic conversation trace --------------------------------------------------------------

# Quantile knots (probability, tokens) of the Azure LLM inference trace 2023, conversation.
# Published: median, p90, p99, max. Chosen by us: the minimum and p99.9 (the shape of the
# tails), one of p25/p75, and the other (None below) solved so the distribution's mean equals
# the published mean.
PROMPT_MEAN = 1155.0
PROMPT_KNOTS = ((0.0, 2.0), (0.25, None), (0.5, 1020.0), (0.75, 1250.0), (0.9, 2735.0),
                (0.99, 4142.0), (0.999, 6000.0), (1.0, 14050.0))
OUTPUT_MEAN = 211.0
OUTPUT_KNOTS = ((0.0, 1.0), (0.25, 60.0), (0.5, 129.0), (0.75, None), (0.9, 424.0),
                (0.99, 601.0), (0.999, 800.0), (1.0, 1000.0))
INTERARRIVAL_CV = 1.1


def solve_knots(
    knots: tuple[tuple[float, float | None], ...], mean: float
) -> list[tuple[float, float]]:
    """Fill the one unknown knot so the piecewise-linear quantile function has `mean`."""
    unknown = [i for i, (_, v) in enumerate(knots) if v is None]
    if len(unknown) != 1 or unknown[0] in (0, len(knots) - 1):
        raise ValueError("exactly one interior knot must be unknown")
    u = unknown[0]
    # Mean of a piecewise-linear quantile function: sum over segments of dp * (q0 + q1) / 2.
    # The unknown enters the two segments around it with weight (p[u+1] - p[u-1]) / 2.
    known = 0.0
    for i in range(len(knots) - 1):
        (p0, q0), (p1, q1) = knots[i], knots[i + 1]
        dp = p1 - p0
        known += dp * ((q0 or 0.0) + (q1 or 0.0)) / 2
    weight = (knots[u + 1][0] - knots[u - 1][0]) / 2
    value = (mean - known) / weight
    lo, hi = knots[u - 1][1], knots[u + 1][1]
    assert lo is not None and hi is not None
    if not lo <= value <= hi:
        raise ValueError(f"no monotone knot gives mean {mean}: solved {value:.1f}")
    return [(p, value if q is None else q) for p, q in knots]


def _quantile(knots: list[tuple[float, float]], u: float) -> float:
    i = bisect.bisect_right([p for p, _ in knots], u) - 1
    i = min(max(i, 0), len(knots) - 2)
    (p0, q0), (p1, q1) = knots[i], knots[i + 1]
    return q0 + (q1 - q0) * (u - p0) / (p1 - p0)


def synthetic(rate: float, duration_s: float, seed: int) -> Workload:
    """A conversation-like trace: gamma inter-arrivals (CV 1.1) at `rate` req/s for
    `duration_s`, prompt and output lengths drawn from the published quantiles."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate}, {duration_s}")
    rng = random.Random(seed)
    prompt_q = solve_knots(PROMPT_KNOTS, PROMPT_MEAN)
    output_q = solve_knots(OUTPUT_KNOTS, OUTPUT_MEAN)
    shape = 1.0 / (INTERARRIVAL_CV**2)
    scale = 1.0 / (rate * shape)
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    t = 0.0
    while True:
        t += rng.gammavariate(shape, scale)
        if t >= duration_s:
            break
        arrivals.append(t)
        prompts.append(max(1, round(_quantile(prompt_q, rng.random()))))
        outputs.append(max(1, round(_quantile(output_q, rng.random()))))
    return Workload(arrivals, prompts, outputs)

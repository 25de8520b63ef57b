"""Warp stall samples per SASS instruction, from Nsight Compute's source page (issue 14's
limiter: where each warp of a kernel waits, and on what).

    ncu ... -o REPORT python benchmarks/ncu_decode.py ...            # session26_call.sh n / p
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_stalls.py sass.csv [--kernel 0] [--top 40] [--around 1002]

Prints, for kernel K of the report (in launch order), the share of all stall samples by reason
and the instructions holding the most samples (index, share, times executed, the instruction,
its three largest reasons); --around I prints instructions I - 30 .. I + 5 with their samples
(what a stalled instruction waits for: the producer of its operand is above it). A stall's
share says where warps wait, not what bounds the kernel: the SM's other warps may hide it
(RESULTS.md, twenty-sixth session: the block-table wait, 29% of fp8's samples, removed for no
gain).
"""

from __future__ import annotations

import argparse
import collections
import csv


def kernels(path: str) -> list[list[dict]]:
    """The report's kernels, each a list of its SASS rows (dicts by the CSV's columns)."""
    out, hdr = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                out.append([])
            elif row[0] == "Address":
                hdr = row
            elif hdr is not None and out:
                out[-1].append(dict(zip(hdr, row)))
    return out


def _n(x: str) -> int:
    try:
        return int(x)
    except ValueError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--kernel", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--around", type=int, default=None)
    a = ap.parse_args()
    rows = kernels(a.csv)[a.kernel]
    key = "Warp Stall Sampling (All Samples)"
    reasons = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_n(r[key]) for r in rows) or 1
    by = collections.Counter()
    for r in rows:
        for h in reasons:
            by[h] += _n(r[h])
    print(f"kernel {a.kernel}: {len(rows)} instructions, {total} samples, "
          f"{sum(_n(r['Instructions Executed']) for r in rows)} executed")
    print("by reason: " + ", ".join(f"{h[6:]} {v / total:.1%}" for h, v in by.most_common(10)))
    if a.around is not None:
        for i in range(max(0, a.around - 30), min(len(rows), a.around + 6)):
            r = rows[i]
            print(f"{i:5d} {_n(r[key]):6d} {_n(r['Instructions Executed']):9d}  "
                  f"{r['Source'].strip()[:90]}")
        return
    top = sorted(range(len(rows)), key=lambda i: -_n(rows[i][key]))[:a.top]
    for i in sorted(top):
        r = rows[i]
        big = sorted(((_n(r[h]), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"{i:5d} {_n(r[key]) / total:6.2%} ex={_n(r['Instructions Executed']):>9} "
              f"{r['Source'].strip()[:60]:60s} " + " ".join(f"{n}:{v}" for v, n in big if v))


if __name__ == "__main__":
    main()

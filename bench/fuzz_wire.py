"""Wire fuzzer: hostile and corrupt trajectories through the learner's codec and validation.

The cases and their tally are tests/wire_fuzz.py (the test suite runs them too); this is their command line.

Usage:
  python -m bench.fuzz_wire               # 10,000 cases, seed 0
  python -m bench.fuzz_wire --cases 2000 --seed 1

Last line: ``cases= rejected= crashes= wrong_accepts=`` (and ``valid_rejected=``: valid cases refused, target 0).
"""

from __future__ import annotations

import argparse

from bench._common import result_line
from tests.wire_fuzz import run_fuzz


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    crashes: list[str] = []
    tally = run_fuzz(args.cases, args.seed, on_crash=lambda name, e: crashes.append(f"{name}: {type(e).__name__}: {e}"))
    for line in crashes[:10]:
        print("crash", line)
    print(result_line({"cases": tally.cases, "rejected": tally.rejected, "crashes": tally.crashes,
                       "wrong_accepts": tally.wrong_accepts, "valid_rejected": tally.valid_rejected}))
    return 0 if tally.crashes == 0 and tally.wrong_accepts == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

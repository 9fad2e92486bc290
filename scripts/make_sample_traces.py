"""Write the real sample trace shipped in traces/ from the shared GPT-OSS-20B routing data.

    python scripts/make_sample_traces.py [--every 8] [--src ../shared/traces-real/gptoss20b-fingerprint]

Takes every N-th example (each one sequence's decode run; Apache-2.0 data, see its SOURCE.md),
cuts it into 9-token verify windows and writes traces/gptoss20b-sample.mptrace. Synthetic traces are
not shipped: make them with ``moeplace trace synth --shape kimi-k2 --steps N -o FILE``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from moeplace.trace.load import read_topk_npz
from moeplace.trace.store import TraceHeader, write_trace

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=ROOT.parent / "shared/traces-real/gptoss20b-fingerprint")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "traces/gptoss20b-sample.mptrace")
    args = ap.parse_args()
    with np.load(args.src / "gptoss20b_routing_topk_ids.npz") as z:
        ids, offsets = z["topk_ids"], z["example_offsets"]
    picked = np.arange(0, offsets.size - 1, args.every)
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in picked])
    lengths = offsets[picked + 1] - offsets[picked]
    with tempfile.TemporaryDirectory() as tmp:
        sub = Path(tmp) / "sample.npz"
        np.savez(sub, topk_ids=ids[rows], example_offsets=np.concatenate([[0], np.cumsum(lengths)]),
                 model_name=np.array("openai/gpt-oss-20b"), num_experts=np.array(32))
        header, steps = read_topk_npz(sub)
    header = TraceHeader(model=header.model, source="converted:gptoss20b_routing_topk_ids.npz",
                         notes=f"REAL routing of openai/gpt-oss-20b (GPT-OSS MoE Expert Fingerprinting, Apache-2.0): "
                               f"every {args.every}th of 703 examples, decode runs cut into 9-token verify windows")
    path = write_trace(args.out, header, steps)
    print(f"wrote {path}: {steps.num_steps} steps, {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

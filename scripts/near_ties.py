"""Where two greedy job outputs differ, is the first difference a near-tie?

Reads two job outputs of the same input (e.g. a speculative run and the plain run; their
committed rows only, :mod:`pipeline.output.reader`), finds the rows whose ``output_text`` differs, decodes those rows again in this process, each alone,
with the config's method and with plain decoding, and reports for each the first differing
position and the target's top-2 logit gap there (:mod:`pipeline.engine.exactness`; a
near-tie is a gap below 1e-3).  In float32, batched and single-row passes sum in different
orders, so a row may legitimately take the other branch of a near-tie.

    python scripts/near_ties.py --config configs/real/smollm2-xsum-draft_model.yaml \\
        out/real/smollm2-xsum/draft_model out/real/smollm2-xsum/plain

Prints one line per differing row and a JSON summary; exits 1 if a difference is not at a
near-tie, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _texts(uri: str) -> dict[str, str | None]:
    """The output texts of a job output's committed rows without error, by id
    (:class:`pipeline.output.reader.CommittedOutput`: a killed run's parts are not read)."""
    from pipeline.output.reader import CommittedOutput

    out = CommittedOutput.open(uri)
    if not out.finished:
        print(f"note: {out.describe()}", file=sys.stderr)
    return {r["id"]: r["output_text"] for r in out.rows(["id", "output_text", "error"], provenance=False)
            if r["error"] is None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the job config of the speculative run")
    ap.add_argument("--set", action="append", default=[], help="section.key=value overrides, as the job takes them")
    ap.add_argument("output", help="the speculative run's output")
    ap.add_argument("reference", help="the plain run's output")
    args = ap.parse_args(argv)

    import torch

    from pipeline.config import load_config
    from pipeline.engine.exactness import compare_rows, summarize
    from pipeline.loading import build_engine, load_engine
    from pipeline.prompts import PromptBuilder
    from pipeline.input import read_shard, resolve_shards

    cfg = load_config(args.config, args.set)
    out, ref = _texts(args.output), _texts(args.reference)
    common = sorted(set(out) & set(ref))
    differ = [i for i in common if out[i] != ref[i]]
    print(f"{len(common)} rows in both outputs, {len(common) - len(differ)} identical texts, {len(differ)} differ")
    result = {"rows": len(common), "identical_text": len(common) - len(differ), "checked": []}
    if differ:
        wanted = set(differ)
        texts = {r["id"]: r["text"] for shard in resolve_shards(cfg.input)
                 for r in read_shard(shard, cfg.input).to_pylist() if r["id"] in wanted}
        loaded = load_engine(cfg, "cpu", max_batch_size=1)
        plain = build_engine(loaded.models, None, max_batch_size=1)
        builder = PromptBuilder(loaded.models.tokenizer, cfg.task)
        prompts, outs, refs = [], [], []
        with torch.no_grad():
            for i in differ:
                _, ids = builder.build(texts[i])
                prompts.append(ids)
                outs.append(loaded.engine.generate(ids, loaded.settings).token_ids)
                refs.append(plain.generate(ids, loaded.settings).token_ids)
            checks = compare_rows(loaded.models.target, prompts, outs, refs)
        for i, c in zip(differ, checks):
            where = "identical when decoded alone" if c.identical else f"first differs at new token {c.position}, top-2 gap {c.gap:.2e}"
            print(f"  {i}: {where}{'' if c.near_tie else '  NOT A NEAR-TIE'}")
            result["checked"].append({"id": i, "identical_alone": c.identical, "position": c.position, "gap": c.gap,
                                      "near_tie": c.near_tie})
        result.update(summarize(checks))
    print(json.dumps(result))
    return 0 if all(c["near_tie"] for c in result["checked"]) else 1


if __name__ == "__main__":
    sys.exit(main())

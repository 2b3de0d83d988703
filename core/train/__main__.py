"""`python -m core.train <stage> [options]`: prompts, fixed, distill, features, train, eval, all.

prompts: the prompt set and the held-out split; fixed: conversations from text on the
machine; distill: the target answers the prompts; features: one target forward per
conversation, cached; train: the head; eval: the real engine on held-out prompts.

Every stage is resumable: rerun the same command after an interruption and it continues
where it stopped (distill skips answered prompts, features skips written shards, train
resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from core.models import DEFAULT_HEAD_DIR, ROOT

WORK = ROOT / "runs" / "train"
HELDOUT = ROOT / "assets" / "heldout_prompts.jsonl"
CONVERSATIONS = ROOT / "assets" / "train-data" / "smollm2-distill.jsonl.gz"
HELDOUT_CONVERSATIONS = ROOT / "assets" / "train-data" / "smollm2-heldout-distill.jsonl.gz"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from core.head import HeadLoadError
    from core.models import ModelLoadError
    from core.train.data import DataError

    t0 = time.time()
    stages = ["prompts", "fixed", "distill", "features", "train", "eval"] if args.stage == "all" else [args.stage]
    try:
        for stage in stages:
            print(f"== stage {stage}", flush=True)
            STAGES[stage](args)
    except (DataError, HeadLoadError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m core.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["prompts", "fixed", "distill", "features", "train", "eval", "all"])
    p.add_argument("--target", default="smollm2", help="target model: 'smollm2', a folder or a hub id")
    p.add_argument("--work", type=Path, default=WORK, help="working folder for intermediate files")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--heldout", type=Path, default=HELDOUT, help="held-out prompts (written by 'prompts')")
    p.add_argument("--data", type=Path, action="append", default=None,
                   help="conversation JSONL (ShareGPT or messages style, .gz ok); repeatable. "
                        "Default: the distilled conversations in the work folder, else the shipped ones")
    p.add_argument("--strict", action="store_true", help="refuse malformed JSONL lines instead of skipping")
    g = p.add_argument_group("distill")
    g.add_argument("--batch-size", type=int, default=24)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--until", default=None, help="stop distilling at this UTC time, HH:MM")
    g.add_argument("--max-prompts", type=int, default=None)
    g.add_argument("--split", choices=["train", "heldout"], default="train",
                   help="answer the training prompts, or the held-out ones (for held-out accuracy)")
    g = p.add_argument_group("features / train")
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--shard-tokens", type=int, default=50_000)
    g.add_argument("--feature-dtype", default="bfloat16",
                   help="target dtype for the feature pass (bf16 is ~1.7x cheaper on a CPU with "
                        "avx512_bf16; features are stored as fp16 either way)")
    g.add_argument("--out", type=Path, default=DEFAULT_HEAD_DIR, help="where the trained head is written")
    g.add_argument("--epochs", type=float, default=10.0)
    g.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--unroll", type=int, default=1, help="training-time unroll steps (1 = EAGLE-1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--bf16", action="store_true", help="bf16 autocast for the head's matmuls")
    g = p.add_argument_group("eval")
    g.add_argument("--head", type=Path, default=None, help="head to evaluate (default: --out)")
    g.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts per category")
    g.add_argument("--eval-max-new-tokens", type=int, default=128)
    return p


def stage_prompts(args) -> None:
    from core.train.data import PromptSetConfig, build_prompts, write_jsonl

    train, held = build_prompts(PromptSetConfig())
    write_jsonl(args.work / "prompts.jsonl", [p.to_json() for p in train])
    write_jsonl(args.heldout, [p.to_json() for p in held])
    cats = sorted({p.category for p in train})
    print(f"prompts: {len(train)} for training ({', '.join(cats)}), {len(held)} held out -> {args.heldout}")


def stage_distill(args) -> None:
    from core.models import load_target
    from core.train.data import read_prompts
    from core.train.distill import DistillConfig, distill

    prompts_path = args.work / "prompts.jsonl"
    if not prompts_path.is_file():
        stage_prompts(args)
    deadline = None
    if args.until:
        hh, mm = map(int, args.until.split(":"))
        deadline = datetime.now(timezone.utc).replace(hour=hh, minute=mm, second=0, microsecond=0)
    cfg = DistillConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, deadline=deadline,
                        max_prompts=args.max_prompts)
    target = load_target(args.target)
    if args.split == "heldout":
        n = distill(target, read_prompts(args.heldout), args.work / "heldout_distill.jsonl", cfg)
    else:
        n = distill(target, read_prompts(prompts_path), args.work / "distill.jsonl", cfg)
    print(f"distill: wrote {n} new answer tokens")


def stage_fixed(args) -> None:
    from core.train.data import fixed_conversations, write_jsonl

    rows = fixed_conversations()
    write_jsonl(args.work / "fixed.jsonl", rows)
    by = {}
    for r in rows:
        by[r["source"]] = by.get(r["source"], 0) + 1
    print(f"fixed: {len(rows)} conversations {by} -> {args.work / 'fixed.jsonl'}")


def conversation_files(args, split: str = "train") -> list[Path]:
    if split == "heldout":
        path = args.work / "heldout_distill.jsonl"
        path = path if path.is_file() else HELDOUT_CONVERSATIONS
        return [path] if path.is_file() and not args.data else []
    if args.data:
        return list(args.data)
    local = args.work / "distill.jsonl"
    files = [local if local.is_file() else CONVERSATIONS]
    return files + ([args.work / "fixed.jsonl"] if (args.work / "fixed.jsonl").is_file() else [])


def stage_features(args) -> None:
    from core.models import load_target
    from core.train.data import DataError, read_conversations
    from core.train.features import FeatureConfig, build_features

    target = load_target(args.target, dtype=args.feature_dtype)
    train = [(p, args.work / "features" / source_name(p)) for p in conversation_files(args)]
    held = [(p, args.work / "features_heldout") for p in conversation_files(args, "heldout")]
    jobs = train[:1] + held + train[1:]  # held-out early: it is small and training reports on it
    for path, folder in jobs:
        if not Path(path).is_file():
            raise DataError(f"{path} does not exist: run the distill stage or pass --data")
        convs, report = read_conversations(path, strict=args.strict)
        print(report.summary(), flush=True)
        if convs:
            man = build_features(target, convs, folder, FeatureConfig(shard_tokens=args.shard_tokens))
            tokens = sum(s["tokens"] for s in man["shards"])
            answer = sum(s["assistant_tokens"] for s in man["shards"])
            print(f"features[{folder.name}]: {man['conversations']} conversations, {tokens} tokens "
                  f"({answer} assistant), {man['skipped_no_assistant']} without assistant tokens")


def source_name(path: Path) -> str:
    """Feature folder name for a data file: distill.jsonl and the shipped .jsonl.gz share one."""
    name = Path(path).name.split(".")[0]
    return "distill" if name in ("distill", "smollm2-distill") else name


def stage_train(args) -> None:
    import json

    from core.head import new_head, save_head
    from core.models import load_target
    from core.train.data import DataError
    from core.train.features import load_sequences
    from core.train.trainer import (Frozen, TrainConfig, evaluate_features, format_accuracy,
                                    frequent_tokens, train)

    target = load_target(args.target)
    folders = sorted(p.parent for p in (args.work / "features").glob("*/manifest.json"))
    if not folders:
        raise DataError(f"no feature shards under {args.work / 'features'}: run the features stage first")
    seqs = [s for f in folders for s in load_sequences(f)]
    held = args.work / "features_heldout"
    heldout = load_sequences(held) if (held / "manifest.json").is_file() else []
    val = heldout[::4] or None  # a quarter of them for the periodic check (it costs training time)
    vocab = frequent_tokens(seqs, args.draft_vocab_size, target.model.config.vocab_size)
    fz = Frozen.from_target(target.model, vocab)
    head = new_head(target.model.config, seed=args.seed)
    cfg = TrainConfig(lr=args.lr, epochs=args.epochs, minutes=args.minutes, unroll=args.unroll, seed=args.seed,
                      autocast_bf16=args.bf16)
    n_tok = sum(int(s.loss_mask.sum()) for s in seqs)
    print(f"train: {len(seqs)} sequences, {n_tok} assistant tokens, draft vocab {len(vocab)}, {cfg}", flush=True)
    res = train(head, fz, seqs, cfg, args.work / "ckpt", target.model.config, val=val)
    save_head(head, args.out, draft_vocab=vocab)
    report = {"steps": res.step, "elapsed_s": round(res.elapsed_s), "finished": res.finished,
              "last_train": res.history[-1].__dict__ if res.history else None}
    if val:
        m = evaluate_features(head, fz, val, depth=4)
        print(f"held-out: {format_accuracy(m)}")
        report["heldout"] = m.__dict__
    (args.work / "train_report.json").write_text(json.dumps(report, indent=1))
    print(f"train: head written to {args.out} ({res.step} steps, {res.elapsed_s:.0f} s)")


def stage_eval(args) -> None:
    import json

    from core.config import GenerationConfig
    from core.engine import Engine
    from core.head import load_head
    from core.models import load_target
    from core.train.data import read_prompts
    from core.train.evaluate import evaluate_engine, format_table, pick_prompts, summarize

    target = load_target(args.target)
    head, vocab = load_head(args.head or args.out, target.model.config)
    feature_report = heldout_feature_accuracy(args, head, target, vocab)
    engine = Engine(target, head, vocab)
    config = GenerationConfig(max_new_tokens=args.eval_max_new_tokens)
    prompts = pick_prompts(read_prompts(args.heldout), args.eval_prompts)
    args.work.mkdir(parents=True, exist_ok=True)
    weights = Path(args.head or args.out) / "model.safetensors"
    tag = hashlib.sha256(weights.read_bytes()).hexdigest()[:10] if weights.is_file() else "pickle"
    log = args.work / f"eval_{tag}_{config.max_new_tokens}.jsonl"  # per head: a rerun resumes it
    results = evaluate_engine(engine, prompts, config, log=log)
    reports = summarize(results, config.tree.depth)
    print(f"greedy, {config.tree}, max_new_tokens {config.max_new_tokens}")
    print(format_table(reports))
    out = args.work / "eval.json"
    out.write_text(json.dumps({"tree": str(config.tree), "features": feature_report,
                               "reports": [r.__dict__ for r in reports],
                               "prompts": [r.__dict__ | {"tau": r.tau} for r in results]}, indent=1))


def heldout_feature_accuracy(args, head, target, vocab, depth: int = 4) -> dict | None:
    """Draft top-1/top-3 per depth on the held-out conversations' cached features."""
    import torch

    from core.train.features import load_sequences
    from core.train.trainer import Frozen, evaluate_features, format_accuracy

    folder = args.work / "features_heldout"
    if not (folder / "manifest.json").is_file():
        print("no held-out features (run distill --split heldout, then features): skipping per-depth accuracy")
        return None
    vocab = vocab if vocab is not None else torch.arange(target.model.config.vocab_size)
    seqs = load_sequences(folder)[::2]  # every other conversation: the engine run below is the slow part
    m = evaluate_features(head, Frozen.from_target(target.model, vocab), seqs, depth)
    print(f"held-out draft accuracy (teacher-forced tokens, own features): {format_accuracy(m)}", flush=True)
    return m.__dict__


STAGES = {"prompts": stage_prompts, "fixed": stage_fixed, "distill": stage_distill, "features": stage_features,
          "train": stage_train, "eval": stage_eval}

if __name__ == "__main__":
    sys.exit(main())

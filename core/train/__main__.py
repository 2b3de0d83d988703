"""`python -m core.train <stage> [options]`: prompts, magpie, fixed, distill, followups, features, train, eval, all.

prompts: the prompt set and the held-out split (`--more`: a second set on new topics, for
more data; the held-out split is left as it is); magpie: user prompts written by the target
itself (core.train.magpie; `--count N` in <work>/magpie.jsonl, resumable; `--stats` prints
their topic spread; carves the natural held-out set into assets/heldout_natural.jsonl once
2,000 exist; `--followups` writes second user turns after distilled answers into
<work>/magpie_followups.jsonl); fixed: conversations from text on the machine; distill: the
target answers the prompts (`--sampled-fraction F`: that share at --distill-temperature, the
rest greedily; the natural held-out prompts never); followups: a second question after each
distilled answer (answer them with `distill --prompt-file <work>/followups.jsonl`, which adds
multi-turn conversations to the same file); features: one target forward per conversation,
cached; train: the head; eval: the real engine on held-out prompts.

Self-written prompts, answered greedily and at temperature 0.7 half each (bfloat16 where the CPU has
avx512_bf16; on AVX2 alone float32, 10x the prompts an hour there):
  python -m core.train magpie --threads 1 --count 20000 --distill-dtype bfloat16
  python -m core.train distill --threads 1 --prompt-file runs/train/magpie.jsonl \
      --answers runs/train/magpie_distill.jsonl --sampled-fraction 0.5 --distiller engine
  python -m core.train magpie --threads 1 --followups --distill-dtype bfloat16
  python -m core.train distill --threads 1 --prompt-file runs/train/magpie_followups.jsonl \
      --answers runs/train/magpie_distill.jsonl --sampled-fraction 0.5
(train on them with --data runs/train/magpie_distill.jsonl and the other conversation files)

--head-kind eagle3 trains the EAGLE-3 head (core.decoding.head3): its features are three fused target
layers (kept apart from EAGLE-1 features, in features_eagle3/), its training unrolls the
head `--unroll` steps on its own states (training-time test, default 7), and it is written
to assets/smollm2-135m-eagle3 unless --out says otherwise.

Every stage is resumable: rerun the same command after an interruption and it continues
where it stopped (distill skips answered prompts, features skips written shards, train
resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import core.threads  # noqa: I001

if __name__ == "__main__":  # run as a command: choose the OpenMP policy before torch loads (core.threads)
    core.threads.start()

from core.models import DEFAULT_HEAD_DIR, ROOT

WORK = ROOT / "runs" / "train"
HELDOUT = ROOT / "assets" / "heldout_prompts.jsonl"
NATURAL_HELDOUT = ROOT / "assets" / "heldout_natural.jsonl"  # self-written prompts never trained on (magpie)
CONVERSATIONS = ROOT / "assets" / "train-data" / "smollm2-distill.jsonl.gz"
# the later topic sets, answered (prompts --set 2 / --set 3, then distill --prompt-file)
MORE_CONVERSATIONS = tuple(ROOT / "assets" / "train-data" / f"smollm2-distill-{name}.jsonl.gz"
                           for name in ("more", "set3"))
HELDOUT_CONVERSATIONS = ROOT / "assets" / "train-data" / "smollm2-heldout-distill.jsonl.gz"
EAGLE3_DIR = ROOT / "assets" / "smollm2-135m-eagle3"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    eagle3 = args.head_kind == "eagle3"
    args.out = args.out or (EAGLE3_DIR if eagle3 else DEFAULT_HEAD_DIR)
    args.unroll = args.unroll or (7 if eagle3 else 1)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from core.decoding.head import HeadLoadError
    from core.models import ModelLoadError
    from core.train.data import DataError

    t0 = time.time()
    stages = (["prompts", "fixed", "distill", "followups", "features", "train", "eval"]
              if args.stage == "all" else [args.stage])
    try:
        for stage in stages:
            print(f"== stage {stage}", flush=True)
            STAGES[stage](args)
            if args.stage == "all" and stage == "followups":  # answer them into the same file
                stage_distill(args, args.work / "followups.jsonl")
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
    p.add_argument("stage", choices=["prompts", "magpie", "fixed", "distill", "followups", "features", "train", "eval",
                                     "all"])
    p.add_argument("--target", default="smollm2", help="target model: 'smollm2', a folder or a hub id")
    p.add_argument("--work", type=Path, default=WORK, help="working folder for intermediate files")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--heldout", type=Path, default=HELDOUT, help="held-out prompts (written by 'prompts')")
    p.add_argument("--data", type=Path, action="append", default=None,
                   help="conversation JSONL (ShareGPT or messages style, .gz ok); repeatable. "
                        "Default: the distilled conversations in the work folder, else the shipped ones")
    p.add_argument("--strict", action="store_true", help="refuse malformed JSONL lines instead of skipping")
    p.add_argument("--more", action="store_true",
                   help="prompts: write <work>/prompts_more.jsonl, the second topic set (core.train.templates."
                        "MORE_TOPICS and more modules' docs), instead of the first set and the held-out split")
    p.add_argument("--set", type=int, default=1, choices=[1, 2, 3],
                   help="prompts: which topic set to write (1: the first set and the held-out split; 2: as --more; "
                        "3: core.train.templates.THIRD_TOPICS -> <work>/prompts_set3.jsonl)")
    g = p.add_argument_group("magpie")
    g.add_argument("--count", type=int, default=20_000,
                   help="magpie: prompts wanted in <work>/magpie.jsonl, counting those already there")
    g.add_argument("--magpie-batch-size", type=int, default=64,
                   help="magpie: rows per batch (finished rows leave it; 64 gave 1.7x the rows/h of 16)")
    g.add_argument("--magpie-max-new-tokens", type=int, default=192, help="magpie: cap of one user turn")
    g.add_argument("--stats", action="store_true",
                   help="magpie: print the topic spread and drop reasons, generate nothing")
    g.add_argument("--followups", action="store_true",
                   help="magpie: write second user turns after the distilled magpie answers instead")
    g.add_argument("--followup-fraction", type=float, default=0.3,
                   help="magpie --followups: share of the distilled conversations that get one")
    g.add_argument("--heldout-natural", type=Path, default=NATURAL_HELDOUT,
                   help="magpie: where the natural held-out set is carved (distill never answers its prompts)")
    g = p.add_argument_group("distill")
    g.add_argument("--batch-size", type=int, default=24,
                   help="prompts answered together (engine: answers in flight as branches of one cache where the "
                        "native step serves)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--distill-dtype", default="float32",
                   help="target dtype for self-distillation (bfloat16: ~1.3x faster batched on AMX CPUs)")
    g.add_argument("--distiller", choices=["batched", "engine"], default="batched",
                   help="batched: transformers in --distill-dtype (the shipped data); engine: the app's own "
                        "engine, in the numerics it serves (on a CPU the native 4-bit step, --batch-size answers "
                        "at a time, each the engine's own answer token for token)")
    g.add_argument("--until", default=None, help="stop distilling at this UTC time, HH:MM")
    g.add_argument("--max-prompts", type=int, default=None)
    g.add_argument("--prompt-file", type=Path, default=None,
                   help="prompts to answer (default: <work>/prompts.jsonl; e.g. <work>/followups.jsonl)")
    g.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="share of the prompts answered by sampling at --distill-temperature (by id hash), the "
                        "rest greedily")
    g.add_argument("--distill-temperature", type=float, default=0.7)
    g.add_argument("--answers", type=Path, default=None,
                   help="distill: where answers are appended (default <work>/distill.jsonl, which the features "
                        "stage reads by default); magpie: the answers to its prompts (default "
                        "<work>/magpie_distill.jsonl), for --followups and the held-out carve")
    g.add_argument("--split", choices=["train", "heldout"], default="train",
                   help="answer the training prompts, or the held-out ones (for held-out accuracy)")
    g = p.add_argument_group("features / train")
    g.add_argument("--head-kind", choices=["eagle1", "eagle3"], default="eagle1",
                   help="EAGLE-1/2 head (last hidden state) or EAGLE-3 (fused layers, training-time test)")
    g.add_argument("--layer-ids", default=None,
                   help="EAGLE-3: target hidden states to fuse, e.g. 2,15,27 (default: 2, L//2, L-3)")
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--shard-tokens", type=int, default=50_000)
    g.add_argument("--feature-dtype", default="bfloat16",
                   help="target dtype for the feature pass with --feature-weights bf16 (bf16 is ~1.7x cheaper "
                        "on a CPU with avx512_bf16; features are stored as fp16 either way); w4a8 runs in the "
                        "served numerics and ignores it")
    g.add_argument("--feature-weights", choices=["bf16", "w4a8"], default="bf16",
                   help="features: the numerics of the answers' features. bf16: transformers' forward; w4a8: "
                        "the native decode step on the GGUF's 4-bit weights x 8-bit activations, the numerics "
                        "the embedded model is served in (the prompt prefilled through transformers, as "
                        "served); EAGLE-1 only. A --work folder holds one kind")
    g.add_argument("--out", type=Path, default=None,
                   help=f"where the trained head is written (default {DEFAULT_HEAD_DIR.name}; "
                        f"eagle3: {EAGLE3_DIR.name})")
    g.add_argument("--ckpt", type=Path, default=None,
                   help="trainer checkpoint folder, resumed from when present (default <work>/ckpt, eagle3: "
                        "<work>/ckpt_eagle3); give each of several parallel runs its own")
    g.add_argument("--init", type=Path, default=None,
                   help="head folder to continue training from, of the --head-kind kind (keeps its draft vocabulary)")
    g.add_argument("--head-layers", type=int, default=None,
                   help="eagle1: decoder layers of the head (published heads: 1). With --init, a head "
                        "with fewer layers is grown to this many, computing what it did at the start "
                        "(the new layers' output projections start at zero)")
    g.add_argument("--freeze", default="",
                   help="comma-separated parameter-name prefixes kept fixed while training, e.g. "
                        "'fc.,layers.0.' to train only the layers --head-layers added")
    g.add_argument("--epochs", type=float, default=10.0)
    g.add_argument("--minutes", type=float, default=None, help="stop training after this many minutes")
    g.add_argument("--val-data", type=Path, default=None,
                   help="held-out conversations (a file like --data's, never trained on): the features stage "
                        "caches them too, and training checks the head on all of them at every checkpoint "
                        "and returns the best head checked (default: the built-in held-out answers, a quarter "
                        "of them, and only without --data)")
    g.add_argument("--patience", type=int, default=0,
                   help="stop training after this many held-out checks in a row without a better depth-1 "
                        "top-1 (0: train for --epochs / --minutes; the best head checked is returned either way)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--unroll", type=int, default=None,
                   help="training-time unroll steps (default 1 = EAGLE-1 recipe; eagle3: 7)")
    g.add_argument("--greedy-targets", action="store_true",
                   help="eagle3: CE against the target's greedy token instead of its distribution")
    g.add_argument("--ce-weight", type=float, default=0.1,
                   help="eagle1: weight of the token loss against the feature regression's 1 (EAGLE-1: 0.1)")
    g.add_argument("--reg-weight", type=float, default=1.0,
                   help="eagle1: weight of the feature regression (0 = token loss only)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--bf16", action="store_true", help="bf16 autocast for the head's matmuls")
    g = p.add_argument_group("eval")
    g.add_argument("--head", type=Path, default=None, help="head to evaluate (default: --out)")
    g.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts per category")
    g.add_argument("--eval-max-new-tokens", type=int, default=128)
    g.add_argument("--eval-dtype", default="auto",
                   help="the engine's numerics for eval (auto: bf16 exact kernels where the probe passes)")
    return p


def stage_prompts(args) -> None:
    from core.train.data import PromptSetConfig, build_prompts, more_prompts, write_jsonl

    topic_set = 2 if args.more else args.set
    if topic_set > 1:  # a later, disjoint prompt set; the held-out file is left alone
        more = more_prompts(PromptSetConfig(), topic_set=topic_set)
        out = args.work / ("prompts_more.jsonl" if topic_set == 2 else f"prompts_set{topic_set}.jsonl")
        write_jsonl(out, [p.to_json() for p in more])
        print(f"prompts: {len(more)} more training prompts on new topics (set {topic_set}) -> {out}")
        return

    train, held = build_prompts(PromptSetConfig())
    write_jsonl(args.work / "prompts.jsonl", [p.to_json() for p in train])
    write_jsonl(args.heldout, [p.to_json() for p in held])
    cats = sorted({p.category for p in train})
    print(f"prompts: {len(train)} for training ({', '.join(cats)}), {len(held)} held out -> {args.heldout}")


def stage_distill(args, prompt_file: Path | None = None) -> None:
    from core.models import load_target
    from core.train.data import DataError, read_prompts
    from core.train.distill import DistillConfig, distill, distill_engine

    explicit = prompt_file or args.prompt_file
    prompts_path = explicit or args.work / "prompts.jsonl"
    if not prompts_path.is_file():
        if explicit:
            raise DataError(f"{prompts_path} does not exist (the followups stage writes <work>/followups.jsonl)")
        stage_prompts(args)
    deadline = next_time(args.until) if args.until else None
    cfg = DistillConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, deadline=deadline,
                        max_prompts=args.max_prompts, sampled_fraction=args.sampled_fraction,
                        temperature=args.distill_temperature, seed=args.seed)
    if args.distiller == "engine":
        from core.decoding.engine import Engine

        engine = Engine.load(args.target)
        print(f"distill: the engine answers ({engine.numerics.step or engine.numerics.dtype}; "
              f"{'speculative' if engine.has_head else 'plain'})", flush=True)
        run = lambda prompts, out: distill_engine(engine, prompts, out, cfg)  # noqa: E731
    else:
        target = load_target(args.target, dtype=args.distill_dtype)
        run = lambda prompts, out: distill(target, prompts, out, cfg)  # noqa: E731
    if args.split == "heldout":
        n = run(read_prompts(args.heldout), args.work / "heldout_distill.jsonl")
    else:
        natural = heldout_ids(args.heldout_natural)
        prompts = [p for p in read_prompts(prompts_path) if p.id not in natural]
        n = run(prompts, args.answers or args.work / "distill.jsonl")
    print(f"distill: wrote {n} new answer tokens")


def heldout_ids(path: Path) -> set[str]:
    """Ids of the natural held-out prompts (none before it is carved): never answered for training."""
    from core.train.distill import read_records

    return {str(r["id"]) for r in read_records(path) if "id" in r}


def stage_magpie(args) -> None:
    from core.models import load_target
    from core.train.distill import done_ids, read_records
    from core.train.magpie import MagpieConfig, followups, magpie, stats_table

    out = args.work / "magpie.jsonl"
    if args.stats:
        print(stats_table(read_records(out), read_records(args.work / "magpie_rejected.jsonl")))
        return
    cfg = MagpieConfig(count=args.count, batch_size=args.magpie_batch_size, max_new_tokens=args.magpie_max_new_tokens,
                       seed=args.seed, deadline=next_time(args.until) if args.until else None)
    target = load_target(args.target, dtype=args.distill_dtype)
    answers = args.answers or args.work / "magpie_distill.jsonl"
    if args.followups:
        n = followups(target, read_records(answers), args.work / "magpie_followups.jsonl", cfg, args.followup_fraction)
        print(f"magpie: {n} follow-ups written (answer with: distill --prompt-file "
              f"{args.work / 'magpie_followups.jsonl'})")
        return
    magpie(target, out, cfg, heldout_path=args.heldout_natural, distilled_ids=done_ids(answers))


def next_time(hhmm: str, now: datetime | None = None) -> datetime:
    """The next moment the UTC clock reads HH:MM: today, or tomorrow once that time has passed
    (`--until 00:30` given at 23:40 means in 50 minutes, not a deadline already gone)."""
    from core.train.data import DataError

    try:
        hh, mm = map(int, hhmm.split(":"))
        now = now or datetime.now(timezone.utc)
        at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    except ValueError as e:
        raise DataError(f"--until takes a UTC time as HH:MM (e.g. 00:30), got {hhmm!r}") from e
    return at if at > now else at + timedelta(days=1)


def stage_followups(args) -> None:
    from core.train.data import DataError, followup_prompts, write_jsonl
    from core.train.distill import read_records

    src = args.work / "distill.jsonl"
    if not src.is_file():
        raise DataError(f"{src} does not exist: run the distill stage first (follow-ups continue its answers)")
    fus = followup_prompts(read_records(src), args.seed)
    write_jsonl(args.work / "followups.jsonl", [p.to_json() for p in fus])
    print(f"followups: {len(fus)} second turns -> {args.work / 'followups.jsonl'} "
          f"(answer with: distill --prompt-file {args.work / 'followups.jsonl'})")


def stage_fixed(args) -> None:
    from core.train.data import fixed_conversations, write_jsonl

    rows = fixed_conversations()
    write_jsonl(args.work / "fixed.jsonl", rows)
    by = {}
    for r in rows:
        by[r["source"]] = by.get(r["source"], 0) + 1
    print(f"fixed: {len(rows)} conversations {by} -> {args.work / 'fixed.jsonl'}")


def conversation_files(args, split: str = "train") -> list[Path]:
    if split == "heldout" and args.val_data:
        return [args.val_data]
    if split == "heldout":
        path = args.work / "heldout_distill.jsonl"
        path = path if path.is_file() else HELDOUT_CONVERSATIONS
        return [path] if path.is_file() and not args.data else []
    if args.data:
        return list(args.data)
    local = args.work / "distill.jsonl"
    files = [local if local.is_file() else CONVERSATIONS]
    files += [path for path in MORE_CONVERSATIONS if path.is_file()]
    return files + ([args.work / "fixed.jsonl"] if (args.work / "fixed.jsonl").is_file() else [])


def stage_features(args) -> None:
    from core.models import load_target
    from core.train.data import DataError, drop_contained, read_conversations
    from core.train.features import FeatureConfig, build_features

    step = None
    if args.feature_weights == "bf16":
        target = load_target(args.target, dtype=args.feature_dtype)
    else:  # the served numerics: the native step on the GGUF's blocks (the start-up probe checks it)
        from core.decoding.numerics import load_numerics

        target, numerics, step = load_numerics(args.target, dtype="auto", attention="auto", device="cpu",
                                               load_in_4bit=False, check=True, weights=args.feature_weights)
        print(f"features: {numerics.step}", flush=True)
    train = [(p, feature_dir(args) / source_name(p)) for p in conversation_files(args)]
    held = [(p, feature_dir(args, "heldout")) for p in conversation_files(args, "heldout")]
    fcfg = FeatureConfig(shard_tokens=args.shard_tokens, layer_ids=layer_ids(args, target.model.config),
                         weights=args.feature_weights)
    jobs = train[:1] + held + train[1:]  # held-out early: it is small and training reports on it
    for path, folder in jobs:
        if not Path(path).is_file():
            raise DataError(f"{path} does not exist: run the distill stage or pass --data")
        convs, report = read_conversations(path, strict=args.strict)
        convs, contained = drop_contained(convs)
        print(report.summary() + (f"; {contained} are the opening of a longer (follow-up) conversation "
                                  "and train inside it" if contained else ""), flush=True)
        if convs:
            man = build_features(target, convs, folder, fcfg, step)
            tokens = sum(s["tokens"] for s in man["shards"])
            answer = sum(s["assistant_tokens"] for s in man["shards"])
            print(f"features[{folder.name}]: {man['conversations']} conversations, {tokens} tokens "
                  f"({answer} assistant), {man['skipped_no_assistant']} without assistant tokens")


def feature_dir(args, split: str = "train", kind: str | None = None) -> Path:
    """EAGLE-1 and EAGLE-3 features live apart (different widths)."""
    name = "features" if (kind or args.head_kind) == "eagle1" else "features_eagle3"
    return args.work / (name if split == "train" else name + "_heldout")


def feature_source(args, split: str = "train") -> tuple[Path, bool]:
    """(folder, last_only). An EAGLE-1 head trains on EAGLE-3 features' last hidden state
    (`final`, the same tensor EAGLE-1 features hold) when it has no features of its own,
    so one feature pass serves both kinds."""
    own = feature_dir(args, split)
    if args.head_kind == "eagle3" or any(own.glob("**/manifest.json")):
        return own, False
    fused = feature_dir(args, split, kind="eagle3")
    if any(fused.glob("**/manifest.json")):
        print(f"features: using the last hidden state of the EAGLE-3 features in {fused}", flush=True)
        return fused, True
    return own, False


def layer_ids(args, target_config) -> tuple[int, ...] | None:
    from core.decoding.head3 import default_layer_ids

    if args.head_kind == "eagle1":
        return None
    if args.layer_ids:
        return tuple(int(i) for i in args.layer_ids.split(","))
    return default_layer_ids(target_config.num_hidden_layers)


def source_name(path: Path) -> str:
    """Feature folder name for a data file: distill.jsonl and the shipped .jsonl.gz share one."""
    name = Path(path).name.split(".")[0]
    return "distill" if name in ("distill", "smollm2-distill") else name


def stage_train(args) -> None:
    import json

    import torch

    from core.models import load_target
    from core.train.data import DataError
    from core.train.features import load_sequences, read_manifest
    from core.train.trainer import Frozen, TrainConfig, format_accuracy, frequent_tokens, train

    target = load_target(args.target)
    root, last_only = feature_source(args)
    folders = sorted(p.parent for p in root.glob("*/manifest.json"))
    if not folders:
        raise DataError(f"no feature shards under {feature_dir(args)}: run the features stage first")
    seqs = [s for f in folders for s in load_sequences(f, last_only=last_only)]
    held, held_last = feature_source(args, "heldout")
    heldout = load_sequences(held, last_only=held_last) if (held / "manifest.json").is_file() else []
    # a file of held-out conversations is checked whole; of the built-in ones a quarter (checks cost training time)
    val = (heldout if args.val_data else heldout[::4]) or None
    if args.val_data and not val:
        raise DataError(f"no held-out features for --val-data {args.val_data}: run the features stage with it first")
    layers = read_manifest(folders[0]).get("layer_ids")
    if args.init is not None:  # warm start: continue from an existing head of this kind and its vocabulary
        from core.decoding.head import load_head
        from core.decoding.head3 import head_kind, load_head3

        if head_kind(args.init) != args.head_kind:
            raise DataError(f"--init {args.init} is an {head_kind(args.init)} head, but --head-kind is "
                            f"{args.head_kind}; pass a head of the same kind")
        if args.head_kind == "eagle3":
            head = load_head3(args.init, target.model.config)
            vocab = head.target_ids()
        else:
            head, vocab = load_head(args.init, target.model.config)
            vocab = vocab if vocab is not None else torch.arange(target.model.config.vocab_size)
            if args.head_layers and args.head_layers != head.config.num_hidden_layers:
                from core.decoding.head import grow_head

                try:
                    head = grow_head(head, args.head_layers, seed=args.seed)
                except ValueError as e:
                    raise DataError(f"--head-layers {args.head_layers} with --init {args.init}: {e}") from e
        head = head.train().requires_grad_(True)
        _, recipe = new_trainee(args, target.model, vocab, layers)
    else:
        vocab = frequent_tokens(seqs, args.draft_vocab_size, target.model.config.vocab_size)
        head, recipe = new_trainee(args, target.model, vocab, layers)
    fz = Frozen.from_target(target.model, vocab)
    cfg = TrainConfig(lr=args.lr, epochs=args.epochs, minutes=args.minutes, unroll=args.unroll, seed=args.seed,
                      autocast_bf16=args.bf16, noise=0.1 if args.head_kind == "eagle1" else 0.0,
                      soft_targets=not args.greedy_targets, ce_weight=args.ce_weight,
                      reg_weight=args.reg_weight, patience=args.patience,
                      frozen=tuple(p.strip() for p in args.freeze.split(",") if p.strip()))
    n_tok = sum(int(s.loss_mask.sum()) for s in seqs)
    print(f"train: {args.head_kind}, {len(seqs)} sequences, {n_tok} assistant tokens, draft vocab {len(vocab)}, "
          f"{cfg}", flush=True)
    ckpt = args.ckpt or args.work / ("ckpt" if args.head_kind == "eagle1" else "ckpt_eagle3")
    res = train(head, fz, seqs, cfg, ckpt, target.model.config, val=val, recipe=recipe)
    recipe.save(head, args.out, vocab)
    report = {"steps": res.step, "elapsed_s": round(res.elapsed_s), "finished": res.finished,
              "last_train": res.history[-1].__dict__ if res.history else None}
    if val:
        m = recipe.evaluate(head, fz, val, max(4, args.unroll))
        print(f"held-out: {format_accuracy(m)}")
        report["heldout"] = m.__dict__
        report["best"] = res.best.to_json()
        report["stopped_early"] = res.stopped_early
    report_name = f"train_report{'' if args.head_kind == 'eagle1' else '_eagle3'}.json"
    (args.ckpt / "train_report.json" if args.ckpt else args.work / report_name).write_text(json.dumps(report, indent=1))
    print(f"train: head written to {args.out} ({res.step} steps, {res.elapsed_s:.0f} s)")


def new_trainee(args, target_model, vocab, feature_layers):
    """A fresh head of the chosen kind and its training recipe. An EAGLE-3 head starts its
    own norm and LM head at the target's final norm and LM-head rows of the draft vocabulary
    (so its first drafts already read its state as a last hidden state)."""
    target_config = target_model.config
    if args.head_kind == "eagle1":
        from core.decoding.head import new_head
        from core.train.trainer import EAGLE1

        return new_head(target_config, seed=args.seed, layers=args.head_layers or 1), EAGLE1
    from core.decoding.head3 import new_head3
    from core.train.data import DataError
    from core.train.trainer3 import EAGLE3

    if args.head_layers not in (None, 1):
        raise DataError(f"--head-layers {args.head_layers}: the EAGLE-3 layout has exactly one decoder "
                        "layer; deeper heads are EAGLE-1/2 (--head-kind eagle1)")
    if feature_layers is None:
        raise DataError("these features hold only the last hidden state: build EAGLE-3 features first "
                        "(`features --head-kind eagle3`)")
    ids = vocab.sort().values
    head = new_head3(target_config, ids, layer_ids=tuple(feature_layers), seed=args.seed,
                     lm_rows=target_model.lm_head.weight[ids].detach().float(),
                     norm_weight=target_model.model.norm.weight.detach().float())
    return head, EAGLE3


def stage_eval(args) -> None:
    """Per-depth accuracy on held-out features, then the real engine (the default numerics:
    bf16 batch-invariant kernels where the probe passes, and the head's tuned or shipped
    tree) on held-out prompts. Either kind of head."""
    import json
    from dataclasses import replace

    from core.config import GenerationConfig
    from core.decoding.engine import Engine
    from core.decoding.head import load_head
    from core.decoding.head3 import head_kind, load_head3
    from core.models import load_target
    from core.train.data import read_prompts
    from core.train.evaluate import evaluate_engine, format_table, pick_prompts, summarize

    folder = Path(args.head or args.out)
    args.head_kind = head_kind(folder)  # the checkpoint says which kind it is
    target = load_target(args.target)  # fp32, as in training, for the feature accuracy
    if args.head_kind == "eagle3":
        head = load_head3(folder, target.model.config)
        feature_report = heldout_feature_accuracy(args, head, target, head.target_ids(), depth=max(4, args.unroll))
    else:
        head, vocab = load_head(folder, target.model.config)
        feature_report = heldout_feature_accuracy(args, head, target, vocab)
    del target, head
    engine = Engine.load(args.target, head=str(folder), dtype=args.eval_dtype)
    print(f"eval: {engine.numerics.describe()}, tree {engine.default_tree} ({engine.tree_origin})", flush=True)
    config = replace(GenerationConfig(max_new_tokens=args.eval_max_new_tokens), tree=engine.default_tree)
    prompts = pick_prompts(read_prompts(args.heldout), args.eval_prompts)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / f"eval_{eval_tag(folder, config)}_{config.max_new_tokens}_{args.eval_dtype}.jsonl"  # a rerun resumes it
    results = evaluate_engine(engine, prompts, config, log=log)
    reports = summarize(results, config.tree.depth)
    print(f"greedy, {config.tree}, max_new_tokens {config.max_new_tokens}")
    print(format_table(reports))
    out = args.work / f"eval_{args.head_kind}.json"
    out.write_text(json.dumps({"head": str(folder), "kind": args.head_kind, "numerics": engine.numerics.describe(),
                               "tree": str(config.tree), "features": feature_report,
                               "reports": [r.__dict__ for r in reports],
                               "prompts": [r.__dict__ | {"tau": r.tau} for r in results]}, indent=1))
    print(f"eval: written to {out}")


def eval_tag(folder: Path, config) -> str:
    """Names an eval's resumable log: the head's weights, its draft vocabulary and the tree, so
    that a head copied with another vocabulary or tree never resumes from the wrong results."""
    h = hashlib.sha256(str(config.tree).encode())
    for name in ("model.safetensors", "pytorch_model.bin", "draft_vocab.safetensors"):
        if (folder / name).is_file():
            h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()[:10]


def heldout_feature_accuracy(args, head, target, vocab, depth: int = 4) -> dict | None:
    """Draft top-1/top-3 per depth on the held-out conversations' cached features."""
    import torch

    from core.train.features import load_sequences
    from core.train.trainer import EAGLE1, Frozen, format_accuracy

    folder, last_only = feature_source(args, "heldout")
    if not (folder / "manifest.json").is_file():
        print(f"no held-out features in {folder} (run distill --split heldout, then features): "
              "skipping per-depth accuracy")
        return None
    vocab = vocab if vocab is not None else torch.arange(target.model.config.vocab_size)
    # every other conversation: the engine run below is the slow part
    seqs = load_sequences(folder, last_only=last_only)[::2]
    if args.head_kind == "eagle3":
        from core.train.trainer3 import EAGLE3 as recipe
    else:
        recipe = EAGLE1
    m = recipe.evaluate(head, Frozen.from_target(target.model, vocab), seqs, depth)
    print(f"held-out draft accuracy (teacher-forced tokens, own features): {format_accuracy(m)}", flush=True)
    return m.__dict__


STAGES = {"prompts": stage_prompts, "magpie": stage_magpie, "fixed": stage_fixed, "distill": stage_distill,
          "followups": stage_followups, "features": stage_features, "train": stage_train, "eval": stage_eval}

if __name__ == "__main__":
    sys.exit(main())

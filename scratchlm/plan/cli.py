"""`scratchlm plan`: rank DP x TP x PP x CP layouts of a model on a cluster, or calibrate this machine.

    scratchlm plan --model MODEL --cluster h100x8_nvlink --prompt-len 2048 --output-len 256 \\
        --concurrency 64
    scratchlm plan --calibrate --out recipes/clusters/local.toml

    scratchlm plan --model deepseek-v3 --cluster h100x8_ib_fp8 --nodes 2 --concurrency 256

MODEL is a model path (anything `scratchlm.model.load` reads), an HF config.json, a TOML/JSON file of `ModelConfig`
fields (e.g. recipes/clusters/models/llama3-70b.toml), or a shipped shape by name (llama3-8b, llama3-70b,
smollm2-135m, deepseek-v3, kimi-k2); the default is SmolLM2-135M. A mixture-of-experts model's layouts include
expert parallelism (EP); the table then shows the all-to-alls' share of a decode step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scratchlm.model.config import ModelConfig
from scratchlm.plan.cluster import cluster_to_toml, load_cluster
from scratchlm.plan.cost import Workload, explain, plan


def load_model_config(path: str | None) -> ModelConfig:
    """A `ModelConfig` from a TOML/JSON file of its fields, an HF config.json (by its `model_type`), or from a model
    checkpoint (weights are loaded too)."""
    if path is None:
        from scratchlm.defaults import default_model_path

        path = str(default_model_path())
    p = Path(path)
    if p.suffix == ".json" and p.exists():
        import json

        data = json.loads(p.read_text())
        if isinstance(data, dict) and "model_type" in data:  # an HF config.json
            from scratchlm.model import families

            return families.config_from_hf(data, str(p))
    if p.suffix in (".toml", ".json"):
        from scratchlm.config import load_config

        return load_config(ModelConfig, p)
    if not p.exists():
        raise ValueError(f"--model {path}: no such file or directory (expected a model path or a ModelConfig "
                         ".toml/.json)")
    from scratchlm.model import load

    return load(p).config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `scratchlm plan`."""
    parser.add_argument("--model", default=None, help="model path, an HF config.json, a TOML/JSON file of "
                        "ModelConfig fields, or a shipped shape by name (llama3-8b, llama3-70b, smollm2-135m, "
                        "deepseek-v3, kimi-k2); default: SmolLM2-135M")
    parser.add_argument("--cluster", default=None, help="cluster TOML, or a shipped one by name (h100x8_nvlink, "
                        "h100x8_ib, h100x8_ib_fp8, cpu16_25gbe, gpu1000_ib); default: calibrate this machine")
    parser.add_argument("--nodes", type=int, default=None, help="override the cluster's node count")
    parser.add_argument("--ep-kv", choices=["replicated", "sharded"], default="replicated",
                        help="expert parallelism's KV cache: every EP replica keeps the whole pool and all-gathers "
                        "each step's new K/V (replicated: what `scratchlm serve --expert-parallel-size` does) or "
                        "each replica its own sequences' (sharded: DeepSeek's deployment)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests served at once")
    parser.add_argument("--world", type=int, default=None, help="ranks to use (default: every device)")
    parser.add_argument("--objective", choices=["throughput", "ttft"], default="throughput",
                        help="what to rank the layouts by")
    parser.add_argument("--top", type=int, default=10, help="layouts to show")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine at the model's shapes (linear rate vs rows, softmax and "
                        "elementwise rates, overheads, activation memory, gloo all-reduce) and print or write a "
                        "cluster TOML")
    parser.add_argument("--out", type=Path, default=None, help="with --calibrate: write the cluster TOML here")
    parser.add_argument("--pairformer-tokens", type=int, default=None, metavar="N",
                        help="plan a Pairformer trunk (scratchlm.fold, Boltz-2 widths) of N tokens instead: memory "
                        "per rank and time per block for each DAP world size (see scratchlm/plan/pairformer.py)")
    parser.add_argument("--pairformer-world", default="1,2,4", help="with --pairformer-tokens: DAP world sizes")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="with --pairformer-tokens: per-rank memory budget; the row chunk is chosen to fit it")


def format_table(preds, top: int) -> str:
    """A plain-text table of the first `top` predictions (with expert parallelism in any of them: the all-to-alls'
    share of a decode step and of a prefill)."""
    moe = any(p.layout.ep > 1 or p.experts_touched for p in preds)
    head = (f"{'layout':<26}{'fits':<6}{'GiB/rank':>9}{'W':>7}{'KV':>7}{'act':>7}{'prefill ms':>12}"
            f"{'TPOT ms':>10}{'TTFT ms':>10}{'tok/s':>10}" + (f"{'a2a dec':>9}{'a2a pre':>9}" if moe else "")
            + "  bottleneck")
    rows = [head, "-" * len(head)]
    g = 2**30
    for p in preds[:top]:
        a2a = (f"{p.decode_a2a_s / p.tpot_s if p.tpot_s else 0:>9.0%}"
               f"{p.prefill_a2a_s / p.prefill.total if p.prefill.total else 0:>9.0%}") if moe else ""
        rows.append(f"{str(p.layout):<26}{'yes' if p.feasible else 'no':<6}{p.memory_bytes / g:>9.2f}"
                    f"{p.weights_bytes / g:>7.2f}{p.kv_bytes / g:>7.2f}{p.activation_bytes / g:>7.2f}"
                    f"{p.prefill.total * 1e3:>12.1f}{p.tpot_s * 1e3:>10.2f}{p.ttft_s * 1e3:>10.1f}"
                    f"{p.throughput:>10.1f}{a2a}  {p.bottleneck}")
    return "\n".join(rows)


def describe_model(c: ModelConfig) -> str:
    """One line: parameters, active parameters per token (MoE), what a token keeps in the KV cache."""
    kv = sum(c.kv_elements_per_token(i) for i in range(c.n_layers))
    text = f"model: {c.num_parameters() / 1e9:.2f}B parameters"
    if c.moe.n_experts:
        moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
        text += (f", {c.active_parameters() / 1e9:.2f}B active per token ({moe} MoE blocks of {c.moe.n_experts} "
                 f"experts, top-{c.moe.top_k}{', a shared expert' if c.moe.d_shared else ''})")
    kind = "MLA latent + RoPE key" if c.mla.kv_lora_rank else "K and V"
    return text + f"; KV cache: {kv:,} elements per token ({kind})"


def run(args: argparse.Namespace) -> int:
    """Run `scratchlm plan`."""
    if args.pairformer_tokens is not None:
        from scratchlm.plan.pairformer import run_cli

        return run_cli(args)
    try:
        from scratchlm.config import resolve_recipe

        if args.model is not None and not Path(args.model).exists():  # a shipped model shape, by name
            args.model = str(resolve_recipe(args.model, "clusters/models", "--model"))
        config = load_model_config(args.model)
        if args.calibrate:
            from scratchlm.plan.calibrate import calibrate

            spec = calibrate(model=config)  # at the model's shapes
            text = cluster_to_toml(spec, "measured by `scratchlm plan --calibrate` (one thread per rank)")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text)
                print(f"wrote {args.out}", file=sys.stderr)
            print(text, end="")
            if args.cluster is None and args.model is None:
                return 0
            cluster = spec
        else:
            cluster = load_cluster(resolve_recipe(args.cluster, "clusters", "--cluster")) if args.cluster else None
        if cluster is not None and args.nodes is not None:
            if args.nodes <= 0:
                raise ValueError(f"--nodes {args.nodes}: must be positive")
            cluster.nodes = args.nodes
        if cluster is None:
            print("no --cluster given: calibrating this machine first (use --calibrate --out FILE to keep it)",
                  file=sys.stderr)
            from scratchlm.plan.calibrate import calibrate

            cluster = calibrate(model=config)
        work = Workload(args.prompt_len, args.output_len, args.concurrency)
        ranked = plan(config, work, cluster, args.objective, args.world, ep_kv=args.ep_kv)
    except (ValueError, FileNotFoundError) as e:
        print(f"scratchlm plan: error: {e}", file=sys.stderr)
        return 2
    print(f"cluster {cluster.name}: {cluster.nodes} node(s) x {cluster.devices_per_node} devices; workload: prompt "
          f"{work.prompt_len}, output {work.output_len}, concurrency {work.concurrency}; "
          f"{len(ranked)} layouts of {ranked[0].layout.world} ranks")
    print(describe_model(config))
    print(format_table(ranked, args.top))
    print()
    print(explain(ranked, args.objective))
    return 0


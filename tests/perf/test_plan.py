"""FLOPs (crm.perf.flops), the memory plan (crm.perf.memory) and crm-plan: hand-checked arithmetic, the
figures of docs/PERFORMANCE.md, and the CLI for every model size."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from transformers import Qwen3Config, Qwen3ForCausalLM

import crm_configs
from crm.cli.plan import main as plan_main
from crm.perf.flops import (PEAK_FLOPS, ModelShape, flops_per_token, mfu, peak_flops,
                       tokens_per_s_at)
from crm.perf.memory import GIB, host_startup_plan, memory_plan, tokens_per_record
from crm.perf.network import Links, choose_sharding, network_plan
from crm.models.backbone import build_classifier

# A Qwen3 small enough to count by hand: h 64, 2 layers, 4 heads x 16 (q width 64), 2 kv heads
# (k width 32), intermediate 128, vocabulary 100, tied embeddings, 2 labels (no bias anywhere).
SMALL = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True)
# One layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288; q/k norms 16 + 16; gate/up/down
# 3 x 64x128 = 24,576; two RMSNorms 2 x 64: 37,024.
LAYER = 12_288 + 32 + 24_576 + 128
NON_EMBEDDING = 2 * LAYER + 64 + 64 * 2  # + final norm + score head (64 x 2)
TOTAL = NON_EMBEDDING + 100 * 64  # + the (tied) embedding


@pytest.fixture(scope="module")
def small() -> ModelShape:
    return ModelShape.from_config(Qwen3Config(**SMALL, num_labels=2, pad_token_id=0))


@pytest.fixture(scope="module")
def shapes() -> dict[str, ModelShape]:
    return {arch: ModelShape.from_model(build_classifier(num_labels=2, pad_token_id=0, arch=arch,
                                                         attention="sdpa", device="meta"))
            for arch in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")}


# -- FLOPs ----------------------------------------------------------------------------------------

def test_shape_counts_a_small_qwen3_by_hand(small):
    assert (small.total_params, small.non_embedding_params, small.layer_params) == (
        TOTAL, NON_EMBEDDING, LAYER) == (80_640, 74_240, 37_024)
    assert small.root_params == 100 * 64 + 64 + 128
    assert (small.layers, small.hidden, small.heads, small.kv_heads, small.head_dim,
            small.intermediate) == (2, 64, 4, 2, 16, 128)


def test_flops_per_token_by_hand(small):
    # 6 N + 12 L H d S = 6 x 74,240 + 12 x 2 x 4 x 16 x 10 = 445,440 + 15,360
    assert flops_per_token(small, 10) == 460_800
    assert flops_per_token(small, 10, training=False) == 153_600
    assert flops_per_token(small, 0) == 6 * NON_EMBEDDING  # the attention term grows with S only


def test_parameter_counts_match_perf_md(shapes):
    expected = {"qwen3-0.6b": (0.596, 0.440), "qwen3-1.7b": (1.721, 1.409),
                "qwen3-4b": (4.022, 3.634), "qwen3-8b": (7.568, 6.946)}
    for arch, (total, non_embedding) in expected.items():
        s = shapes[arch]
        assert round(s.total_params / 1e9, 3) == total, arch
        assert round(s.non_embedding_params / 1e9, 3) == non_embedding, arch


def test_tokens_per_s_at_40_percent_mfu_match_perf_md(shapes):
    # docs/PERFORMANCE.md: a Qwen3-4B reward model at 4k tokens and 40% MFU on H100: about 13.6k tokens/s/GPU;
    # 8B: about 8.1k.
    for arch, expected in (("qwen3-4b", 13.6e3), ("qwen3-8b", 8.1e3)):
        per_token = flops_per_token(shapes[arch], 4096)
        rate = tokens_per_s_at(0.4, per_token, PEAK_FLOPS["h100"])
        assert rate == pytest.approx(expected, rel=0.005), arch
        assert mfu(rate, per_token, PEAK_FLOPS["h100"]) == pytest.approx(0.4)


def test_peaks_unknown_gpus_and_overrides():
    assert peak_flops("h100") == peak_flops("H200") == 989e12 and peak_flops("a100") == 312e12
    assert peak_flops(None) is None and peak_flops("v100") is None
    assert peak_flops("v100", peak=1e12) == 1e12  # a configured peak wins
    assert mfu(1000.0, 1e9, None) is None and tokens_per_s_at(0.4, 1e9, None) is None
    if not torch.cuda.is_available():
        assert peak_flops("auto") is None  # a CPU has no peak


# -- memory ---------------------------------------------------------------------------------------

def plan_bytes(plan: dict) -> dict:
    return {k[:-4]: round(v * GIB) for k, v in plan.items() if k.endswith("_gib")
            and k not in ("gpu_memory_gib", "reserved_gib", "usable_gib")}


def test_memory_plan_by_hand(small):
    p = plan_bytes(memory_plan(small, world=2, seq_len=10, micro_batch_size=1, kind="pairwise",
                               precision="bf16-mixed"))
    assert p["params"] == p["grads"] == TOTAL * 4 / 2 == 161_280
    assert p["optimizer"] == TOTAL * 8 / 2
    assert p["states"] == TOTAL * 16 / 2 and p["states_all_gpus"] == TOTAL * 16
    # root (embedding + final norm + head) and 2 layers in bf16, one layer's fp32 gradient
    assert p["unsharded"] == (small.root_params + 2 * LAYER) * 2 + LAYER * 4 == 309_376
    # a bf16 layer keeps 16h + 10q + 10k + 8i + 8H + 4KV + 8 bytes per token:
    # 1,024 + 640 + 320 + 1,024 + 32 + 8 + 8 = 3,056; outside the layers 6h + 12 + 4d = 460.
    # checkpointed: 10 tokens x (L h x 2 B + one layer recomputed + the rest); full: every layer
    assert p["activations_checkpointed"] == 10 * (2 * 64 * 2 + 3056 + 460) == 37_720
    assert p["activations_full"] == 10 * (2 * 3056 + 460) == 65_720
    fixed = p["states"] + p["unsharded"]
    assert p["total"] == p["total_checkpointed"] == fixed + 37_720
    assert p["total_full"] == fixed + 65_720

    eager = plan_bytes(memory_plan(small, world=2, seq_len=10, attention="eager"))
    assert eager["activations_checkpointed"] == 10 * (2 * 64 * 2 + 3056 + 4 * 10 * 6 + 460)  # softmax

    pointwise = plan_bytes(memory_plan(small, world=2, seq_len=10, kind="pointwise"))
    assert pointwise["activations_checkpointed"] == 2 * 37_720  # chosen + rejected rows

    true16 = plan_bytes(memory_plan(small, world=2, seq_len=10, precision="bf16-true"))
    assert true16["states"] == TOTAL * 8 / 2 and true16["activations_full"] == 65_720
    # float32: 24h + 16q + 16k + 16i + 48 = 5,168 per layer, 8h + 12 + 8d = 652 outside
    fp32 = plan_bytes(memory_plan(small, world=2, seq_len=10, precision="32-true"))
    assert fp32["states"] == TOTAL * 16 / 2 and fp32["activations_full"] == 10 * (2 * 5168 + 652)
    # DDP / one GPU, bf16-mixed: autocast over float32 weights, a bf16 copy of every matmul weight
    ddp = plan_bytes(memory_plan(small, world=2, seq_len=10, strategy="ddp"))
    assert ddp["states"] == TOTAL * 16  # whole on every GPU
    assert ddp["unsharded"] == 0 and ddp["weight_copies"] == 2 * LAYER * 2
    assert ddp["activations_full"] == 10 * (2 * (26 * 64 + 2032) + 652)


@pytest.mark.parametrize("precision,strategy", [("bf16-true", "fsdp"), ("bf16-mixed", "ddp"),
                                                ("32-true", "fsdp")])
def test_activations_are_what_autograd_keeps(precision, strategy):
    """The plan's eager activations against a live count of every tensor autograd saves in a
    forward of the whole classifier (crm.perf.inventory), within the per-row head and loss."""
    from crm.models.heads import PairwiseCRM
    from crm.perf.inventory import saved_bytes
    from crm.perf.memory import compute_mode

    mode = compute_mode(precision, strategy)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    crm = PairwiseCRM(build_classifier(num_labels=2, pad_token_id=0, arch=SMALL, attention="sdpa",
                                       dtype=dtype))
    ids = torch.randint(1, 100, (1, 24))
    parameters = {p.untyped_storage().data_ptr() for p in crm.parameters()}

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            return crm(ids, torch.ones_like(ids))

    kept = saved_bytes(run, parameters)
    plan = plan_bytes(memory_plan(ModelShape.from_model(crm.model), world=1, seq_len=24,
                                  precision=precision, strategy=strategy, activation_checkpointing=False))
    # autocast's bf16 weight copies: the plan counts the norms' weights too, which stay float32
    copies = plan["weight_copies"] - (2 * 2 * (2 * 64 + 2 * 16) if mode == "autocast" else 0)
    # left out of the plan: the head's float32 row (its input) and, for a bf16 backbone, the float32
    # copy of its 2 x 64 weight (crm.models.heads.head_at); the logits within the slack
    head = 4 * 64 + (4 * 2 * 64 if mode == "bf16" else 0)
    assert abs(kept - plan["activations_full"] - copies - head) <= 64


def test_packed_rows_count_the_tokens_a_micro_batch_computes(small):
    """Packed (stream.packing): a pairwise record is its one row, as padded; a pointwise pair is
    its criteria + query (p of a row) once and its two responses, S x (2 - p) tokens, at the same
    bytes per token (the attention's S still the row's)."""
    kw = dict(world=2, seq_len=10, micro_batch_size=4)
    for ckpt in (True, False):
        pairs = [plan_bytes(memory_plan(small, kind="pairwise", packing=packed, prompt_share=0.2,
                                        activation_checkpointing=ckpt, **kw)) for packed in (False, True)]
        assert pairs[0] == pairs[1]
    padded = memory_plan(small, kind="pointwise", **kw)
    packed = memory_plan(small, kind="pointwise", packing=True, prompt_share=0.2, **kw)
    # by hand: 4 records x 10 x (2 - 0.2) = 72 tokens x (2 x 64 x 2 + 3,056 + 460) bytes, checkpointed
    assert (padded["tokens_per_micro_batch"], packed["tokens_per_micro_batch"]) == (80, pytest.approx(72))
    assert (padded["rows_per_micro_batch"], packed["rows_per_micro_batch"]) == (8, 1)
    assert packed["activations_checkpointed_gib"] * GIB == pytest.approx(72 * (2 * 64 * 2 + 3056 + 460))
    for key in ("activations_checkpointed_gib", "activations_full_gib"):
        assert packed[key] == pytest.approx(padded[key] * (2 - 0.2) / 2)
    assert packed["states_gib"] == padded["states_gib"]
    assert packed["prompt_share"] == 0.2 and padded["prompt_share"] is None
    # the step's compute follows the tokens; FLOPs per token keep S = the row
    net = [network_plan(small, num_nodes=1, devices=2, seq_len=10, micro_batch_size=4, kind="pointwise",
                        packing=packed, prompt_share=0.2) for packed in (False, True)]
    assert net[1]["tokens_per_micro_step"] == pytest.approx(0.9 * net[0]["tokens_per_micro_step"])
    assert net[1]["compute_seconds_per_micro_step"] == pytest.approx(
        72 * flops_per_token(small, 10) / (0.45 * 989e12))
    assert net[1]["records_per_s_per_gpu"] > net[0]["records_per_s_per_gpu"]
    assert tokens_per_record("pointwise", 10, prompt_share=0.5) == 20  # padded: the share is ignored
    for share in (-0.1, 1.0):
        with pytest.raises(ValueError, match=f"prompt_share={share}: expected 0 <= prompt_share < 1"):
            tokens_per_record("pointwise", 10, packing=True, prompt_share=share)


def test_one_micro_batch_per_step_peaks_at_the_larger_of_gradients_and_activations(small):
    kw = dict(world=1, seq_len=10, activation_checkpointing=False)
    held = plan_bytes(memory_plan(small, **kw))  # accumulation: the earlier gradients stay
    alone = plan_bytes(memory_plan(small, accumulating=False, **kw))
    fixed = held["params"] + held["optimizer"] + held["unsharded"]
    assert held["total"] == fixed + held["grads"] + held["activations_full"]
    assert alone["total"] == fixed + max(held["grads"], held["activations_full"])
    long_rows = plan_bytes(memory_plan(small, accumulating=False, **{**kw, "seq_len": 10_000}))
    assert long_rows["total"] == fixed + long_rows["activations_full"]  # activations dominate


def test_fits_keeps_the_headroom(small):
    p = memory_plan(small, world=1, seq_len=10, gpu_memory_gib=80)
    assert p["usable_gib"] == 80 * 0.9 - 2.0 and p["fits"]
    total, full = p["total_checkpointed_gib"], p["total_full_gib"]
    exact = (total + 1.0) / 0.8  # 20% headroom and 1 GiB reserved leave exactly `total`
    kw = dict(world=1, seq_len=10, headroom_fraction=0.2, reserved_gib=1.0)
    assert memory_plan(small, gpu_memory_gib=exact * (1 + 1e-7), **kw)["fits"]
    assert not memory_plan(small, gpu_memory_gib=exact * (1 - 1e-7), **kw)["fits"]
    off = memory_plan(small, gpu_memory_gib=exact * (1 + 1e-7), activation_checkpointing=False, **kw)
    assert full > total and off["total_gib"] == full
    assert not off["fits"] and not off["fits_full"] and off["fits_checkpointed"]
    with pytest.raises(ValueError, match="precision='fp8'"):
        memory_plan(small, world=1, seq_len=10, precision="fp8")


@pytest.mark.parametrize("arch,states_total,states_per_gpu,block_kib", [
    ("qwen3-4b", 60, 7.5, 180), ("qwen3-8b", 113, 14, 288)])
def test_qwen3_4b_and_8b_fit_8_x_80_gib_as_perf_md_says(shapes, arch, states_total,
                                                        states_per_gpu, block_kib):
    s = shapes[arch]
    p = memory_plan(s, world=8, seq_len=4096, micro_batch_size=1, precision="bf16-mixed",
                    activation_checkpointing=True, gpu_memory_gib=80)
    assert round(p["states_all_gpus_gib"]) == states_total
    assert round(p["states_gib"], 0 if states_per_gpu == 14 else 1) == states_per_gpu
    assert s.layers * s.hidden * 2 == block_kib * 1024  # block inputs per token (docs/PERFORMANCE.md)
    assert p["fits"] and p["total_gib"] < 0.5 * p["usable_gib"]
    assert p["activations_checkpointed_gib"] < p["activations_full_gib"] / 5


def test_host_memory_at_start_up_by_hand(small):
    h = host_startup_plan(small, world=4, devices=2, checkpoint_bytes=2, param_bytes=4)
    # 2 nodes x 2 GPUs: a node reads half of the bf16 checkpoint; a rank holds a quarter of the
    # root (the embedding nearly all of it) in flight, read (2 B) and converted (4 B).
    assert round(h["pretrained_page_cache_gib"] * GIB) == TOTAL * 2 * 2 // 4
    assert round(h["pretrained_in_flight_per_rank_gib"] * GIB) == small.root_params * 6 // 4
    assert round(h["pretrained_gib"] * GIB) == TOTAL + 2 * small.root_params * 6 // 4
    assert round(h["random_init_gib"] * GIB) == 2 * TOTAL * 4  # both ranks: the whole fp32 model
    with pytest.raises(ValueError, match="whole nodes"):
        host_startup_plan(small, world=3, devices=2)


def test_qwen3_8b_from_a_checkpoint_needs_about_its_bf16_size_per_8_gpu_node(shapes):
    h = host_startup_plan(shapes["qwen3-8b"], world=16, devices=8)
    assert round(h["pretrained_page_cache_gib"], 2) == round(7.568e9 * 2 / 2 / GIB, 2)  # half of it
    assert h["pretrained_gib"] < 0.1 * h["random_init_gib"]  # every rank whole: 8 x 28 GiB


# -- crm-plan -------------------------------------------------------------------------------------

MODELS = sorted(p.stem for p in (Path(crm_configs.__file__).parent / "model").glob("*.yaml"))


def run_plan(tmp_path: Path, *overrides: str) -> tuple[Path, str]:
    """crm-plan in-process as Hydra runs it: the run dir is hydra.run.dir under paths.root_dir."""
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("plan", overrides=[f"paths.root_dir={tmp_path}", *overrides],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    run_dir = Path(cfg.hydra.run.dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        plan_main(cfg)
    finally:
        HydraConfig.instance().cfg = None
    return run_dir, json.loads((run_dir / "plan.json").read_text())


@pytest.mark.parametrize("model", MODELS)
def test_crm_plan_writes_plan_json_for_every_model_size(model, tmp_path, capsys):
    run_dir, plan = run_plan(tmp_path, f"model={model}")
    assert run_dir == tmp_path / "outputs" / "plan" / model
    out = capsys.readouterr().out
    assert f"crm-plan: {model} pairwise, 1 node(s) x 8 GPUs" in out and "fits: yes" in out
    assert plan["model"]["name"] == model and plan["memory"]["world"] == 8
    # what crm-train would record for this run (crm.training.resolve), printed and written
    assert plan["resolved"]["sharding"] == plan["sharding"] and "resolved (crm.training.resolve" in out
    assert plan["memory"]["fits"] is True
    assert plan["flops"]["train_per_token"] == pytest.approx(3 * plan["flops"]["forward_per_token"])
    assert plan["flops"]["tokens_per_s_per_gpu"] == pytest.approx(
        0.4 * 989e12 / plan["flops"]["train_per_token"])


def test_crm_plan_overrides_and_unknown_gpu(tmp_path, capsys):
    _, plan = run_plan(tmp_path, "model=qwen3-8b", "trainer.num_nodes=2", "trainer.devices=4",
                       "kind=pointwise", "packing=false", "seq_len=2048", "gpu=v100",
                       "activation_checkpointing=false", "sharding=fsdp")
    mem = plan["memory"]
    assert mem["world"] == 8 and mem["rows_per_micro_batch"] == 2 and mem["seq_len"] == 2048
    assert mem["total_gib"] == mem["total_full_gib"]
    assert round(mem["states_gib"]) == 14  # the same 8 GPUs share the states
    assert plan["model"]["num_labels"] == 1
    assert plan["flops"]["tokens_per_s"] is None
    assert "no peak known for gpu=v100" in capsys.readouterr().out
    _, plan = run_plan(tmp_path, "model=qwen3-8b", "gpu=v100", "peak_tflops=125")
    assert plan["flops"]["peak_flops_per_gpu"] == 125e12
    # one micro batch a step (64 = 8 x 8 GPUs): gradients and activations peak apart
    _, alone = run_plan(tmp_path, "model=qwen3-0.6b", "micro_batch_size=8", "global_batch_size=64")
    _, held = run_plan(tmp_path, "model=qwen3-0.6b", "micro_batch_size=8", "global_batch_size=128")
    assert not alone["memory"]["accumulating"] and held["memory"]["accumulating"]
    assert alone["memory"]["total_gib"] < held["memory"]["total_gib"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # a one-line error, exit 2
        run_plan(tmp_path, "model=qwen3-0.6b", "micro_batch_size=8", "global_batch_size=100")
    assert stop.value.code == 2
    assert "global_batch_size=100 is not a multiple of micro_batch_size=8" in capsys.readouterr().err


def test_crm_plan_counts_packed_tokens(tmp_path, capsys):
    """packing=true (the default, a GPU run's) and prompt_share: tokens a record and a micro batch,
    activations, records/s; pairwise as padded; a share outside [0, 1) refused in one line."""
    _, padded = run_plan(tmp_path, "model=qwen3-4b", "kind=pointwise", "micro_batch_size=2", "packing=false")
    _, packed = run_plan(tmp_path, "model=qwen3-4b", "kind=pointwise", "micro_batch_size=2")
    out = capsys.readouterr().out
    assert packed["packing"] and packed["prompt_share"] == 0.2 and padded["prompt_share"] is None
    assert (padded["tokens_per_record"], packed["tokens_per_record"]) == (8192, pytest.approx(4096 * 1.8))
    assert packed["tokens_per_micro_batch"] == pytest.approx(2 * 4096 * 1.8)
    assert "tokens: 7,373 a record (criteria + query, 0.2 of a row, once), 14,746 a micro batch" in out
    for key in ("activations_checkpointed_gib", "activations_full_gib"):
        assert packed["memory"][key] == pytest.approx(padded["memory"][key] * 0.9)
    pf, uf = packed["flops"], padded["flops"]
    assert pf["train_per_token"] == uf["train_per_token"]  # S: a record's own row, packed or not
    assert pf["records_per_s"] == pytest.approx(pf["tokens_per_s"] / (4096 * 1.8))
    assert pf["records_per_s"] == pytest.approx(uf["records_per_s"] / 0.9)
    _, pairwise = run_plan(tmp_path, "model=qwen3-4b", "prompt_share=0.5")
    _, unpacked = run_plan(tmp_path, "model=qwen3-4b", "packing=false")
    assert pairwise["memory"]["total_gib"] == unpacked["memory"]["total_gib"]
    assert pairwise["tokens_per_record"] == 4096 and pairwise["prompt_share"] is None
    capsys.readouterr()
    for share in ("1.0", "-0.1"):
        with pytest.raises(SystemExit) as stop:
            run_plan(tmp_path, "model=qwen3-4b", f"prompt_share={share}")
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.strip() == (f"{Path(sys.argv[0]).name}: prompt_share={float(share)}: expected 0 <= "
                               "prompt_share < 1 (the share of a pointwise row that is criteria + query)")


def test_crm_plan_console_script_is_installed():
    assert (Path(sys.executable).parent / "crm-plan").is_file()


def test_crm_plan_host_memory_follows_model_path(tmp_path, capsys):
    _, plan = run_plan(tmp_path, "model=qwen3-8b")
    out = capsys.readouterr().out
    assert not plan["host_startup"]["pretrained"]
    assert plan["host_startup"]["checkpoint_bytes_per_param"] == 2  # a Qwen3 release: bf16
    assert "random init, every rank the whole model" in out and out.count("<- configured") == 2
    line = next(row for row in out.splitlines() if row.startswith("random init"))
    assert line.endswith("<- configured")

    checkpoint = tmp_path / "base"
    Qwen3ForCausalLM(Qwen3Config(**SMALL)).save_pretrained(checkpoint)  # float32
    _, plan = run_plan(tmp_path, "model=qwen3-8b", f"model.path={checkpoint}", "trainer.devices=2")
    host = plan["host_startup"]
    assert host["pretrained"] and host["checkpoint_bytes_per_param"] == 4
    assert round(host["pretrained_page_cache_gib"] * GIB) == TOTAL * 4  # one node reads it all
    line = next(row for row in capsys.readouterr().out.splitlines()
                if row.startswith("from model.path,"))
    assert line.endswith("<- configured")


# -- network (crm.perf.network) -------------------------------------------------------------------

ROOT = 100 * 64 + 64 + 128  # embedding, final norm, head of SMALL
# 1 and 0.25 GB/s: a ring over both nodes runs at min(1, 2 x 0.25) = 0.5 GB/s; no latency
SLOW = Links(intra_node_busbw_gbs=1.0, inter_node_busbw_gbs=0.25, intra_node_latency_s=0.0,
             inter_node_latency_s=0.0)


def test_network_plan_by_hand(small):
    kw = dict(num_nodes=2, devices=2, seq_len=10, accumulation=2, compute_mfu=0.5, peak_flops=1e10,
              links=SLOW)
    p = network_plan(small, sharding="fsdp", grad_sync="step", **kw)
    gather_fwd, gather_bwd, scatter = p["collectives"]
    # flat FSDP over W = 4 ranks: a ring moves 3/4 of each buffer per GPU, at 0.5e9 B/s
    assert gather_fwd["per_gpu_bytes"] == TOTAL * 2 * 3 / 4 == 120_960  # bf16, every unit
    assert gather_bwd["per_gpu_bytes"] == 1 * LAYER * 2 * 3 / 4 == 55_536  # L - 1 = 1 layer again
    assert scatter["per_gpu_bytes"] == TOTAL * 4 * 3 / 4 == 241_920  # fp32
    assert (gather_fwd["count"], gather_bwd["count"], scatter["count"]) == (2, 2, 1)  # step: once
    assert gather_fwd["seconds"] == pytest.approx(120_960 / 0.5e9)
    # compute: 10 tokens x 460,800 FLOPs at 0.5 x 1e10 FLOP/s = 9.216e-4 s a micro step
    assert p["compute_seconds_per_micro_step"] == pytest.approx(9.216e-4)
    # micro step 1: gathers 3.52992e-4 s < compute, exposed: the root's gather, 13,184 x 3/4 B;
    # micro step 2 adds the reduce-scatter (8.36832e-4 s, hidden) and the root's, 26,368 x 3/4 B
    root_gather, root_scatter = ROOT * 2 * 0.75 / 0.5e9, ROOT * 4 * 0.75 / 0.5e9
    assert p["exposed_seconds_per_step"] == pytest.approx(2 * root_gather + root_scatter)
    assert p["step_seconds"] == pytest.approx(2 * 9.216e-4 + 7.9104e-5)
    assert p["mfu"] == pytest.approx(2 * 10 * 460_800 / (1.922304e-3 * 1e10))
    # micro_batch: a reduce-scatter on each micro step
    every = network_plan(small, sharding="fsdp", grad_sync="micro_batch", **kw)
    assert every["collectives"][2]["count"] == 2
    assert every["step_seconds"] == pytest.approx(p["step_seconds"] + root_scatter)

    h = network_plan(small, sharding="hsdp", grad_sync="step", **kw)
    gather_fwd, _, scatter, reduce = h["collectives"]
    # HSDP: rings of 2 GPUs in a node (1/2 of each buffer at 1e9 B/s), reduce-scatter every micro
    # step; the all-reduce of the fp32 shards (P x 4 / 2) between the 2 nodes, 2 x 1/2 at 0.25e9 B/s
    assert gather_fwd["per_gpu_bytes"] == TOTAL * 2 / 2 and scatter["count"] == 2
    assert reduce["per_gpu_bytes"] == TOTAL * 4 / 2 and reduce["count"] == 1
    assert reduce["seconds"] == pytest.approx(TOTAL * 2 / 0.25e9)  # 6.4512e-4 s
    assert h["replicate_group"] == {"ranks": 2, "busbw_gbs": 0.25}
    # the last micro step: 80,640 + 37,024 + 161,280 B at 1e9 B/s and the all-reduce, 6.4512e-4 s:
    # 9.24064e-4 s against 9.216e-4 s of compute, 2.464e-6 s exposed besides the root's
    exposed = 2 * (ROOT / 1e9 + ROOT * 2 / 1e9) + ROOT * 4 / 2 / 0.25e9 + 2.464e-6
    assert h["exposed_seconds_per_step"] == pytest.approx(exposed)
    # latency: once per ring step (ranks - 1) and per unit (L + 1 = 3 for the forward gather)
    lat = network_plan(small, sharding="fsdp", **{**kw, "links": Links(1.0, 0.25, 0.0, 1e-6)})
    assert lat["collectives"][0]["seconds"] == pytest.approx(120_960 / 0.5e9 + 3 * 3 * 1e-6)
    with pytest.raises(ValueError, match="sharding='zero'"):
        network_plan(small, sharding="zero", **kw)


def test_qwen3_8b_on_4_nodes_of_8_h100_reaches_the_mfu_goal(shapes):
    """docs/PERFORMANCE.md section 10: 4,096-token rows, 256 records a step (8 micro steps of 1)."""
    s = shapes["qwen3-8b"]
    kw = dict(num_nodes=4, devices=8, seq_len=4096, micro_batch_size=1, accumulation=8)
    hsdp, fsdp = (network_plan(s, sharding=x, **kw) for x in ("hsdp", "fsdp"))
    assert hsdp["mfu"] >= 0.35 and round(hsdp["mfu"], 3) == 0.440
    assert round(fsdp["mfu"], 3) == 0.445
    # checkpointing's recompute costs a third more compute: under the goal
    assert network_plan(s, sharding="hsdp", activation_checkpointing=True, **kw)["mfu"] < 0.35
    assert choose_sharding(s, num_nodes=4, devices=8, seq_len=4096, micro_batch_size=1) == "hsdp"


def test_choose_sharding_is_hsdp_where_one_node_holds_the_states(small):
    kw = dict(seq_len=10, micro_batch_size=1)
    assert choose_sharding(small, num_nodes=2, devices=2, **kw) == "hsdp"
    assert choose_sharding(small, num_nodes=1, devices=8, **kw) == "fsdp"  # one node
    assert choose_sharding(small, num_nodes=4, devices=1, **kw) == "fsdp"  # one GPU per node
    node = memory_plan(small, world=2, seq_len=10, compiled=True)
    # a GPU just too small for the states sharded over one node's 2 GPUs: flat FSDP
    too_small = (node["total_gib"] + 2.0) / 0.9 * (1 - 1e-6)
    assert choose_sharding(small, num_nodes=2, devices=2, gpu_memory_gib=too_small, **kw) == "fsdp"
    assert choose_sharding(small, num_nodes=2, devices=2, gpu_memory_gib=too_small * 1.01, **kw) == "hsdp"


def test_grad_sync_step_holds_flat_fsdps_gradients_unsharded(small):
    held = plan_bytes(memory_plan(small, world=4, seq_len=10, unsharded_grads=True))
    plain = plan_bytes(memory_plan(small, world=4, seq_len=10))
    assert held["accumulated_grads"] == TOTAL * 4 and plain["accumulated_grads"] == 0
    assert held["total"] == plain["total"] + TOTAL * 4
    alone = plan_bytes(memory_plan(small, world=4, seq_len=10, unsharded_grads=True, accumulating=False))
    assert alone["accumulated_grads"] == 0  # one micro step a step: reduced at once


def test_crm_plan_network_table_and_recommend(tmp_path, capsys):
    _, plan = run_plan(tmp_path, "model=qwen3-8b", "trainer.num_nodes=4", "global_batch_size=256",
                       "activation_checkpointing=false")
    assert plan["sharding"] == "hsdp" and plan["memory"]["world"] == 8  # states over one node
    assert plan["network"]["accumulation"] == 8 and plan["network"]["mfu"] >= 0.35
    assert "predicted step" in capsys.readouterr().out
    _, flat = run_plan(tmp_path, "model=qwen3-8b", "trainer.num_nodes=4", "global_batch_size=256",
                       "activation_checkpointing=false", "sharding=fsdp")
    assert flat["memory"]["world"] == 32 and flat["memory"]["accumulated_grads_gib"] > 28
    _, table = run_plan(tmp_path, "table=true", "table_models=[qwen3-0.6b,qwen3-8b]", "table_nodes=[1,4,64]",
                        "global_batch_size=256")
    rows = {(r["model"], r["num_nodes"]): r for r in table["rows"]}
    assert rows[("qwen3-8b", 4)]["hsdp"]["mfu"] == pytest.approx(
        network_plan(ModelShape.from_arch("qwen3-8b"), num_nodes=4, devices=8, seq_len=4096,
                     accumulation=8, sharding="hsdp", activation_checkpointing=True)["mfu"])
    assert rows[("qwen3-8b", 1)]["hsdp"] is None and rows[("qwen3-8b", 64)]["accumulation"] is None
    out = capsys.readouterr().out
    assert "FSDP step, MFU" in out and "qwen3-0.6b" in out
    _, rec = run_plan(tmp_path, "recommend=true", "model=qwen3-8b", "trainer.num_nodes=4",
                      "global_batch_size=256")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommend: "))
    assert line.split()[1:] == rec["overrides"]
    assert "stream.packing=true" in rec["overrides"]  # the plan's default: packed rows
    _, rec_padded = run_plan(tmp_path, "recommend=true", "model=qwen3-8b", "trainer.num_nodes=4",
                             "global_batch_size=256", "packing=false")
    assert "stream.packing=false" in rec_padded["overrides"]
    # launch/train.sbatch plans the run's own stream.packing
    from crm.cli.train import run_plan_arguments
    # a GPU run packs unless it says not to (auto and true plan packed rows, the plan's default)
    assert not any(a.startswith("packing=") for a in run_plan_arguments([]))
    assert not any(a.startswith("packing=") for a in run_plan_arguments(["stream.packing=true"]))
    assert "packing=false" in run_plan_arguments(["stream.packing=false"])
    # crm-train's parallel.timeout_minutes, sized for a checkpoint save of the 8B on 4 nodes
    from crm.perf.memory import process_group_timeout_minutes
    timeout = process_group_timeout_minutes(ModelShape.from_arch("qwen3-8b"), num_nodes=4)
    assert rec["overrides"][-1] == f"parallel.timeout_minutes={timeout}" == "parallel.timeout_minutes=30"
    best = rec["best"]
    assert best["sharding"] == "hsdp" and not best["activation_checkpointing"]
    assert best["mfu"] >= max(c["mfu"] for c in rec["candidates"]) * 0.98


# -- LoRA -----------------------------------------------------------------------------------------

def test_lora_plan_counts_peft_and_fits_one_gpu_as_the_issue_asks(shapes, tmp_path, capsys):
    from crm.models.factory import LossConfig, ModelConfig, build_crm
    from crm.models.config import DECODER_LINEARS, LoraConfig
    from crm.models.lora import trainable_counts
    from crm.perf.memory import lora_parameters

    # The plan's count of what LoRA trains is peft's (a meta-device build).
    crm = build_crm(ModelConfig(arch="qwen3-0.6b", attention="sdpa"), LossConfig(), num_labels=2,
                    pad_token_id=0, device="meta", lora=LoraConfig(rank=16))
    assert lora_parameters(shapes["qwen3-0.6b"], 16, DECODER_LINEARS) == trainable_counts(crm)["trainable"]
    # The frozen base: 2 bytes a parameter, no gradient or moments.
    s, T = shapes["qwen3-8b"], lora_parameters(shapes["qwen3-8b"], 16, DECODER_LINEARS)
    lora = memory_plan(s, world=1, seq_len=4096, trainable=T)
    frozen = s.total_params - s.hidden * s.num_labels
    assert lora["params_gib"] * GIB == pytest.approx(frozen * 2 + T * 4)
    assert lora["grads_gib"] * GIB == pytest.approx(T * 4) and lora["compute"] == "bf16"
    _, table = run_plan(tmp_path, "one_gpu=true", "seq_len=4096")
    rows = {r["model"]: r for r in table["rows"]}
    assert table["lora_rank"] == 16
    assert rows["qwen3-8b"]["lora"]["fits"]["80"] and not rows["qwen3-8b"]["full"]["fits"]["80"]
    assert rows["qwen3-4b"]["lora"]["fits"]["24"] and not rows["qwen3-4b"]["full"]["fits"]["24"]
    assert "qwen3-8b    lora" in capsys.readouterr().out
    # Its MFU counts no weight gradient for the frozen base: 4 N + attention a token, not 6 N.
    full, frozen = (flops_per_token(s, 4096, frozen_base=f) for f in (False, True))
    assert full - frozen == 2 * s.non_embedding_params

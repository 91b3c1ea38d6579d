"""The whole MoE GPT under expert parallelism equals the single-process model.

Every run goes through the launch path in float64 and logs the single process's per-step losses
and grad norms (the load-balancing loss included) to 1e-9 over 10 steps, dropless: ep2 and ep4,
ep2 x tp2 with sequence parallelism, ep2 x pp2 (1F1B), ep2 with the distributed optimizer,
tp2 x ep2 x dp2 on 8 ranks, ep2 x cp2, and whole experts (expert_tensor_parallel_size=1) with ep4
spanning tp2 x dp2, and ep2 inside each TP pair with the distributed optimizer. Between them the runs cover softmax and sigmoid routing
(DeepSeek's aux-free bias, which must follow the same path on every rank), a shared expert, the
z-loss and a layer list. Checkpoints reshard across expert parallelism: an ep2 checkpoint resumes at
ep1, an ep1 checkpoint at ep4 with the distributed optimizer, both on the single run's
trajectory (the router's selection bias included). Bad configs fail in ``derive`` with one line.
"""

from __future__ import annotations

import pytest

from conftest import SMALL, assert_same_trajectory, compose_config, run_training
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError

STEPS = 10
MOE = [*SMALL, "model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
       "model.num_query_groups=2", "model.seq_length=32", "model.vocab_size=500", "model.ffn_hidden_size=64",
       "model.moe.ffn_hidden_size=32", "precision=fp64", f"trainer.max_steps={STEPS}",
       # No final checkpoint: the resharding checks below use the periodic ones.
       "checkpoint.save_last=false"]
# DeepSeek-style routing: sigmoid scores, aux-free selection bias, a shared expert, z-loss, the
# second layer MoE only; a checkpoint at step 8 (resharded below: two resumed steps show the
# continuation, the router's selection bias included).
DEEPSEEK = ["model.moe.router=sigmoid", "model.moe.expert_bias_rate=0.01", "model.moe.shared_ffn_hidden_size=32",
            "model.moe.z_loss_coeff=0.001", "model.moe.layer_freq=[0,1]", "checkpoint.every_n_steps=8",
            "checkpoint.keep_last=0"]
FORMS = {"mixtral": [], "deepseek": DEEPSEEK}


def ep(size: int, devices: int, *more: str):
    return [f"parallel.expert_parallel_size={size}", f"trainer.devices={devices}", *more]


LAYOUTS = {  # name -> (routing form, layout)
    "ep2": ("deepseek", ep(2, 2)),
    "ep4": ("mixtral", ep(4, 4)),
    "ep2_tp2_sp": ("mixtral", ep(2, 4, "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true")),
    "ep2_pp2": ("deepseek", ep(2, 4, "parallel.pipeline_parallel_size=2")),
    "ep2_distopt": ("mixtral", ep(2, 2, "optim.distributed_optimizer=true")),
    "tp2_ep2_dp2": ("deepseek", ep(2, 8, "parallel.tensor_parallel_size=2", "recompute.granularity=full")),
    "ep2_cp2": ("mixtral", ep(2, 4, "parallel.context_parallel_size=2")),
    # Whole experts (expert_tensor_parallel_size=1): EP spans tp ranks; each TP rank routes its slice.
    "ep4_over_tp2_dp2_whole": ("mixtral", ep(4, 4, "parallel.tensor_parallel_size=2",
                                             "parallel.expert_tensor_parallel_size=1")),
    "ep2_tp2_dp2_whole_distopt": ("deepseek", ep(2, 4, "parallel.tensor_parallel_size=2",
                                                 "parallel.expert_tensor_parallel_size=1",
                                                 "optim.distributed_optimizer=true")),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = {}
    for form, extra in FORMS.items():
        run_dir = tmp_path_factory.mktemp(f"single_{form}")
        out[form] = (run_training([*MOE, *extra], run_dir), run_dir)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ep_losses_equal_single_process(single, name, tmp_path):
    form, layout = LAYOUTS[name]
    rows = run_training([*MOE, *FORMS[form], *layout], tmp_path)
    reference, single_dir = single[form]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert_same_trajectory(rows, reference, rel=1e-9)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["moe_aux_loss"] > 0 and r["moe_load_imbalance"] >= 1 for r in rows)
    if name == "ep2":  # an ep2 checkpoint resumes at ep1; an ep1 one at ep4 with the distributed optimizer
        saved = "checkpoints/step_0000008"
        resumed = run_training([*MOE, *FORMS[form], f"checkpoint.load={tmp_path / saved}"], tmp_path / "at_ep1")
        assert_same_trajectory(resumed, reference[8:], rel=1e-9)
        resumed = run_training([*MOE, *FORMS[form], *ep(4, 4, "optim.distributed_optimizer=true"),
                                f"checkpoint.load={single_dir / saved}"], tmp_path / "at_ep4")
        assert_same_trajectory(resumed, reference[8:], rel=1e-9)


def test_capacity_dropping_is_deterministic_and_logged(tmp_path):
    """With a capacity factor, two ep2 runs give the same losses bit for bit, and every step logs
    the fraction of assignments dropped (capacity 0.5: at least half of them)."""
    overrides = [*MOE, *ep(2, 2), "model.moe.capacity_factor=0.5", "trainer.max_steps=3"]
    first = run_training(overrides, tmp_path / "a")
    second = run_training(overrides, tmp_path / "b")
    assert [r["loss"] for r in first] == [r["loss"] for r in second] and len(first) == 3
    assert all(0.5 <= r["moe_dropped_fraction"] < 1 for r in first)


@pytest.mark.parametrize("overrides, key", [
    (ep(3, 4), "parallel.expert_parallel_size"),  # 8 experts (and dp 4) over 3 ranks
    (ep(4, 2, "parallel.tensor_parallel_size=2"), "parallel.expert_parallel_size"),  # dp 1: ep4 needs whole experts
    (["parallel.tensor_parallel_size=2", "trainer.devices=2", "parallel.expert_tensor_parallel_size=4"],
     "parallel.expert_tensor_parallel_size"),
    (["parallel.expert_parallel_size=2", "trainer.devices=2", "model.moe=null"], "parallel.expert_parallel_size"),
    (["model.moe.top_k=9"], "model.moe.top_k"),
    (["model.moe.router=hash"], "model.moe.router"),
    (["model.moe.layer_freq=[1,0,1]"], "model.moe.layer_freq"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
    (["trainer.devices=2", "parallel.data_parallel=fsdp"], "parallel.data_parallel"),
    (["model.transformer_impl=transformer_engine"], "model.transformer_impl"),
], ids=["ep_not_dividing", "ep_over_tp_needs_whole_experts", "etp_not_1_or_tp", "ep_without_moe", "top_k", "router", "layer_freq", "capacity", "fsdp", "te"])
def test_bad_moe_configs_fail_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        derive(compose_config([*MOE, *overrides]))
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize("model, params", [("mixtral_8x7b", 46.70e9), ("deepseek_moe_16b", 16.38e9)])
def test_published_moe_shapes_derive_with_their_parameter_count(model, params):
    """The published totals (Mixtral 8x7B: 46.7B; DeepSeekMoE 16B: 16.4B), from the shapes alone:
    attention, experts, shared experts, routers, norms and both vocabulary tables."""
    cfg = compose_config([f"model={model}", "trainer.devices=8", "parallel.expert_parallel_size=8"])
    t = derive(cfg).transformer
    h, d, moe = t.hidden_size, t.kv_channels, t.moe
    attention = h * (t.num_attention_heads + 2 * t.num_query_groups) * d + t.num_attention_heads * d * h
    experts = moe.num_experts * 3 * h * moe.ffn_hidden_size + 3 * h * moe.shared_ffn_hidden_size + moe.num_experts * h
    dense = 3 * h * t.ffn_hidden_size
    total = (t.num_layers * (attention + 2 * h) + len(t.moe_layers) * experts
             + (t.num_layers - len(t.moe_layers)) * dense + 2 * t.vocab_size * h + h)
    assert total == pytest.approx(params, rel=0.01)


def test_moe_flops_count_the_experts_a_token_runs_through():
    from megatron_hydra.planning.flops import model_flops_per_token

    moe = derive(compose_config(MOE)).transformer
    dense = derive(compose_config([*MOE, "model.moe=null"])).transformer
    h, s = moe.hidden_size, moe.moe
    per_layer = 2 * h * (s.num_experts + 3 * s.top_k * s.ffn_hidden_size) - 2 * h * 3 * dense.ffn_hidden_size
    assert model_flops_per_token(moe) - model_flops_per_token(dense) == pytest.approx(3 * 2 * per_layer)



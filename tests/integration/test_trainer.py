"""Integration tests for learner.train.trainer.Trainer on the real tiny Qwen2.5-VL policy (CPU, offline)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from arpo_async.config import LearnerConfig
from arpo_async.model.init_model import create_tiny_model
from arpo_async.model.inputs import PromptEncoder, load_policy
from learner.algo.kl_schedule import batch_kl
from learner.train.trainer import (
    Trainer,
    TrainerConfigError,
    TrainerError,
    TrainerInputError,
    TrainSample,
)
from tests.reference_logprobs import completion_logits, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "policy", seed=0)


def _screenshot(colour: str, size: tuple[int, int] = (320, 180)) -> bytes:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle([20, 20, 120, 80], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _sample(
    model_dir: Path, reply: str, advantage: float, *, colour: str = "red", with_image: bool = True
) -> TrainSample:
    """A sample as the sampler would produce it: the prompt through the shared PromptEncoder, the reply's token
    ids, and on-policy behaviour log-probs from the initial checkpoint."""
    encoder = PromptEncoder(model_dir)
    images = [_screenshot(colour)] if with_image else []
    content: list[dict] = [{"type": "text", "text": "Please click the save button."}]
    if with_image:
        content.append({"type": "image"})
    prompt_ids = encoder.encode([{"role": "user", "content": content}], [(320, 180)] * len(images))
    output_ids = encoder.tokenize(reply + "<|im_end|>")
    model, image_processor = load_policy(model_dir)
    with torch.no_grad():
        behaviour = token_logprobs(model, image_processor, prompt_ids, images, output_ids).tolist()
    return TrainSample(prompt_ids, images, output_ids, behaviour, advantage)


@pytest.fixture(scope="module")
def samples(model_dir) -> list[TrainSample]:
    return [
        _sample(model_dir, "Thought: open the file menu\nAction: click(start_box='(10,20)')", 1.5, colour="red"),
        _sample(model_dir, "Thought: wait\nAction: wait()", -0.5, colour="blue"),
        _sample(model_dir, "Action: hotkey(key='ctrl s')", -0.5, with_image=False),
    ]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _mean_logprob(trainer: Trainer, sample: TrainSample) -> float:
    values = trainer.compute_logprobs([sample])[0]
    return sum(values) / len(values)


def test_train_step_changes_weights_and_reports_finite_stats(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    before = _params(trainer)
    stats = trainer.train_step(samples[:2])
    after = _params(trainer)

    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in ("loss", "grad_norm", "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "seconds"):
        assert math.isfinite(stats[key]), key
    assert stats["tokens"] == len(samples[0].output_ids) + len(samples[1].output_ids)
    assert stats["samples"] == 2 and stats["skipped"] == 0.0
    assert stats["grad_norm"] > 0
    # on-policy first step: ratio 1 on every token, nothing clipped, and the loss is -mean(A) per token
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats["clip_frac"] == 0.0
    t0, t1 = len(samples[0].output_ids), len(samples[1].output_ids)
    assert stats["loss"] == pytest.approx(-(1.5 * t0 - 0.5 * t1) / (t0 + t1), rel=1e-3)
    assert trainer.steps == 1


def test_positive_advantage_raises_log_prob_and_negative_lowers_it(model_dir, samples):
    for sample, sign in ((samples[0], +1), (samples[1], -1)):
        trainer = Trainer(model_dir, LearnerConfig(lr=2e-3))
        start = _mean_logprob(trainer, sample)
        for _ in range(20):
            # on-policy: the sampler's log-probs are those of the current weights
            current = TrainSample(sample.prompt_ids, sample.images, sample.output_ids,
                                  trainer.compute_logprobs([sample])[0], sample.advantage)
            trainer.train_step([current])
        end = _mean_logprob(trainer, sample)
        assert sign * (end - start) > 2.0, (sign, start, end)  # measured: ~4 nats either way


def test_clip_stops_the_update_when_every_ratio_is_past_the_trust_region(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    positive = samples[0]
    # proximal log-probs 1 nat below the current ones: ratio e = 2.7 > 1.3 for every token, A > 0 -> all clipped
    proximal = [[x - 1.0 for x in trainer.compute_logprobs([positive])[0]]]
    before = _params(trainer)
    stats = trainer.train_step([positive], proximal_logprobs=proximal)
    assert stats["clip_frac"] == 1.0
    assert stats["ratio_mean"] == pytest.approx(math.e, rel=1e-3)
    assert stats["grad_norm"] == 0.0
    after = _params(trainer)
    # AdamW with a zero gradient still applies weight decay, so only (1 - lr * wd) shrinkage may remain
    for k in before:
        torch.testing.assert_close(after[k], before[k] * (1 - 1e-3 * 0.01), rtol=1e-6, atol=1e-8)


def _gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in trainer.module.named_parameters() if p.grad is not None}


def test_token_budget_micro_batches_give_the_full_batch_gradient(model_dir, samples):
    """Item: the step's gradient does not depend on how its samples are packed (token-level mean over the whole
    step, not a mean of micro-batch means): budgets from one pass down to one sample per micro-batch."""
    batch = samples + [samples[0]]  # 4 samples of 3 different lengths
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in batch)
    results = {}
    for budget in (0, 4 * longest, 2 * longest, longest):
        trainer = Trainer(model_dir, LearnerConfig(lr=1e-3, max_tokens_per_microbatch=budget))
        sums, _, passes = trainer.compute_gradients(batch)
        results[budget] = (sums["loss"], passes, _gradients(trainer))
    assert results[0][1] == 1 and results[longest][1] == len(batch)  # one pass, then one sample per pass
    loss_ref, _, grads_ref = results[0]
    assert grads_ref and all(g.abs().sum() > 0 for g in grads_ref.values() if g.numel() > 100)
    for budget, (loss, _, grads) in results.items():
        assert loss == pytest.approx(loss_ref, rel=1e-5), budget
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_ref[name], rtol=1e-5, atol=1e-7, msg=f"{name} at {budget}")


def test_batched_log_probs_equal_the_unpadded_forward(model_dir, samples):
    """The padded micro-batch forward scores each sample as the plain one-sample forward does."""
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-6, max_tokens_per_microbatch=0))
    batched = trainer.compute_logprobs(samples)
    model, image_processor = load_policy(model_dir)
    for sample, values in zip(samples, batched):
        with torch.no_grad():
            alone = token_logprobs(model, image_processor, sample.prompt_ids, sample.images, sample.output_ids)
        torch.testing.assert_close(torch.tensor(values), alone, rtol=1e-5, atol=1e-5)


def test_reported_entropy_is_the_full_distributions_on_the_trained_tokens(model_dir, samples):
    """``entropy``: token-weighted over the step's tokens and micro-batches, of the whole vocabulary's
    distribution before the update, as one plain forward computes it."""
    model, image_processor = load_policy(model_dir)
    per_token = []
    with torch.no_grad():
        for sample in samples:
            logits = completion_logits(model, image_processor, sample.prompt_ids, sample.images,
                                       sample.output_ids).float()
            per_token.append(torch.distributions.Categorical(logits=logits).entropy())
    expected = float(torch.cat(per_token).mean())
    budget = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)  # one sample per micro-batch
    stats = Trainer(model_dir, LearnerConfig(lr=1e-3, max_tokens_per_microbatch=budget)).train_step(samples)
    assert 0.0 < expected <= math.log(per_token[0].new_tensor(logits.shape[-1]))
    assert stats["entropy"] == pytest.approx(expected, rel=1e-4)


def test_a_sample_longer_than_the_budget_is_a_clear_error(model_dir, samples):
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-6, max_tokens_per_microbatch=longest - 1))
    with pytest.raises(TrainerConfigError, match="learner.max_tokens_per_microbatch"):
        trainer.train_step(samples)


def test_cuda_without_cuda_names_the_key(model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TrainerConfigError, match="learner.device"):
        Trainer(model_dir, LearnerConfig(lr=1e-6, device="cuda"))


def test_bf16_and_gradient_checkpointing_train_close_to_fp32(model_dir, samples):
    """bf16 compute (fp32 master weights and log-softmax) and recomputed activations give the fp32 step's
    gradient direction; gradient checkpointing alone gives the same gradient."""
    ref = Trainer(model_dir, LearnerConfig(lr=1e-3))
    ref.compute_gradients(samples)
    checkpointed = Trainer(model_dir, LearnerConfig(lr=1e-3, gradient_checkpointing=True))
    checkpointed.compute_gradients(samples)
    bf16 = Trainer(model_dir, LearnerConfig(lr=1e-3, dtype="bfloat16"))
    bf16.compute_gradients(samples)
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())
    flat = lambda t: torch.cat([g.flatten() for g in _gradients(t).values()])  # noqa: E731
    torch.testing.assert_close(flat(checkpointed), flat(ref), rtol=1e-5, atol=1e-7)
    cosine = torch.nn.functional.cosine_similarity(flat(bf16), flat(ref), dim=0)
    assert cosine > 0.99
    assert not torch.equal(flat(bf16), flat(ref))  # it did compute in bf16


def test_saved_weights_load_and_match_the_trainer(model_dir, samples, tmp_path):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    trainer.train_step(samples)
    out = trainer.save_weights(tmp_path / "weights" / "v1")

    assert out == tmp_path / "weights" / "v1"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json"} <= names
    assert [p.name for p in out.parent.iterdir()] == ["v1"]  # no temporary folder left behind
    PromptEncoder(out)  # the folder serves prompts exactly like the source checkpoint

    loaded, image_processor = load_policy(out)
    original, _ = load_policy(model_dir)
    with torch.no_grad():
        for sample in samples:
            args = (sample.prompt_ids, sample.images, sample.output_ids)
            saved_lp = token_logprobs(loaded, image_processor, *args)
            torch.testing.assert_close(saved_lp, torch.tensor(trainer.compute_logprobs([sample])[0]),
                                       rtol=1e-5, atol=1e-5)
            assert not torch.allclose(saved_lp, token_logprobs(original, image_processor, *args), atol=1e-4)


def test_save_weights_refuses_to_overwrite_unless_asked(model_dir, samples, tmp_path):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    target = trainer.save_weights(tmp_path / "w")
    with pytest.raises(TrainerError, match="exists"):
        trainer.save_weights(target)
    trainer.train_step(samples[:1])
    trainer.save_weights(target, overwrite=True)
    loaded, image_processor = load_policy(target)
    sample = samples[0]
    with torch.no_grad():
        lp = token_logprobs(loaded, image_processor, sample.prompt_ids, sample.images, sample.output_ids)
    torch.testing.assert_close(lp, torch.tensor(trainer.compute_logprobs([sample])[0]), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_checkpoint_round_trip_restores_model_and_optimizer(model_dir, samples, tmp_path):
    config = LearnerConfig(lr=1e-3)
    trainer = Trainer(model_dir, config)
    trainer.train_step(samples)
    path = trainer.save_checkpoint(tmp_path / "ckpt" / "trainer.pt")

    restored = Trainer(model_dir, config)
    restored.load_checkpoint(path)
    assert restored.steps == 1
    # the next step is identical only if the Adam moments were restored too
    stats_a = trainer.train_step(samples)
    stats_b = restored.train_step(samples)
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-6)
    params_a, params_b = _params(trainer), _params(restored)
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k])


def test_fresh_optimizer_state_differs_from_restored(model_dir, samples, tmp_path):
    """Control for the round trip above: loading only the model weights gives a different second step."""
    config = LearnerConfig(lr=1e-3)
    trainer = Trainer(model_dir, config)
    trainer.train_step(samples)
    state = trainer.state_dict()
    other = Trainer(model_dir, config)
    other.model.load_state_dict(state["model"])
    trainer.train_step(samples)
    other.train_step(samples)
    params_a, params_b = _params(trainer), _params(other)
    assert any(not torch.allclose(params_a[k], params_b[k]) for k in params_a)


def test_bad_batches_are_rejected(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-6))
    good = samples[0]

    def with_(output_ids=None, logprobs=None, advantage=1.0) -> TrainSample:
        return TrainSample(good.prompt_ids, good.images, good.output_ids if output_ids is None else output_ids,
                           good.behaviour_logprobs if logprobs is None else logprobs, advantage)

    with pytest.raises(TrainerInputError, match="at least one"):
        trainer.train_step([])
    with pytest.raises(TrainerInputError, match="behaviour log-probs"):
        trainer.train_step([with_(logprobs=good.behaviour_logprobs[:-1])])
    with pytest.raises(TrainerInputError, match="no output"):
        trainer.train_step([with_(output_ids=[], logprobs=[])])
    with pytest.raises(TrainerInputError, match="advantage"):
        trainer.train_step([with_(advantage=math.nan)])
    with pytest.raises(TrainerInputError, match="proximal"):
        trainer.train_step([good], proximal_logprobs=[])


# ---------------------------------------------------------------- off-policy correction in the trainer


def _with_behaviour(sample: TrainSample, behaviour: list[float], *, replayed: bool = False) -> TrainSample:
    return TrainSample(sample.prompt_ids, sample.images, sample.output_ids, behaviour, sample.advantage,
                       replayed=replayed)


def test_proximal_from_the_forward_pass_equals_a_separate_pre_update_pass(model_dir, samples):
    """train_step's default pi_prox (its own forward, detached) is the pre-update policy: same step as passing
    compute_logprobs() explicitly, under a correction whose weights depend on it."""
    stale = [_with_behaviour(s, [x - 0.3 for x in s.behaviour_logprobs]) for s in samples]
    config = LearnerConfig(lr=1e-3, correction="tis", tis_cap=2.0)
    a, b = Trainer(model_dir, config), Trainer(model_dir, config)
    stats_a = a.train_step(stale)
    stats_b = b.train_step(stale, proximal_logprobs=b.compute_logprobs(stale))
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-5)
    assert stats_a["is_weight_mean"] == pytest.approx(stats_b["is_weight_mean"], rel=1e-5)
    params_a, params_b = _params(a), _params(b)
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k], rtol=1e-4, atol=1e-6)


def test_stale_behaviour_log_probs_are_weighted_by_mode(model_dir, samples):
    """Behaviour log-probs 3 nats below the current policy (pi_prox / pi_behav = e^3 = 20 on every token), as for a
    success replayed from long ago: decoupled filters every token (no gradient), tis truncates the weight at 2
    (twice ARPO's loss), arpo ignores the behaviour policy."""
    sample = samples[0]
    current = Trainer(model_dir, LearnerConfig(lr=1e-6)).compute_logprobs([sample])[0]
    replayed = _with_behaviour(sample, [x - 3.0 for x in current], replayed=True)
    tokens = len(sample.output_ids)
    results = {}
    for mode in ("arpo", "decoupled", "tis"):
        trainer = Trainer(model_dir, LearnerConfig(lr=1e-3, correction=mode))
        results[mode] = trainer.train_step([replayed])
    # ARPO: ratio 1 against the recomputed policy, w = 1: loss = -A = -1.5
    assert results["arpo"]["loss"] == pytest.approx(-1.5, rel=1e-5)
    assert results["arpo"]["is_weight_mean"] == 1.0 and results["arpo"]["is_capped_frac"] == 0.0
    assert results["arpo"]["behaviour_kl"] == pytest.approx(-3.0, abs=1e-4)
    # decoupled (cap 5): every token filtered out
    assert results["decoupled"]["loss"] == 0.0
    assert results["decoupled"]["grad_norm"] == 0.0
    assert results["decoupled"]["is_capped_frac"] == 1.0 and results["decoupled"]["is_weight_mean"] == 0.0
    # tis (cap 2): every weight truncated to 2
    assert results["tis"]["loss"] == pytest.approx(-3.0, rel=1e-5)
    assert results["tis"]["is_weight_mean"] == pytest.approx(2.0) and results["tis"]["is_capped_frac"] == 1.0
    assert results["tis"]["grad_norm"] > results["arpo"]["grad_norm"] > 0
    for stats in results.values():
        assert stats["replayed_tokens"] == tokens


def test_replayed_weights_are_reported_separately(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3, correction="decoupled"))
    current = trainer.compute_logprobs(samples[:2])
    fresh = _with_behaviour(samples[0], current[0])  # on-policy: weight 1
    old = _with_behaviour(samples[1], [x + math.log(2.0) for x in current[1]], replayed=True)  # weight 1/2
    stats = trainer.train_step([fresh, old])
    t0, t1 = len(fresh.output_ids), len(old.output_ids)
    assert stats["replayed_tokens"] == t1
    assert stats["replayed_is_weight_mean"] == pytest.approx(0.5, rel=1e-4)
    assert stats["is_weight_mean"] == pytest.approx((t0 * 1.0 + t1 * 0.5) / (t0 + t1), rel=1e-4)
    assert stats["is_weight_max"] == pytest.approx(1.0, rel=1e-4)


def test_train_batch_splits_into_steps_clipped_against_one_proximal_policy(model_dir, samples):
    config = LearnerConfig(lr=1e-3, correction="decoupled")
    a, b = Trainer(model_dir, config), Trainer(model_dir, config)
    stats = a.train_batch(samples, minibatches=2)
    assert a.steps == 2 and stats["optimizer_steps"] == 2.0
    # reference: pi_prox for the whole batch first, then one step per contiguous half ([0], [1, 2])
    proximal = b.compute_logprobs(samples)
    first = b.train_step(samples[:1], proximal_logprobs=proximal[:1])
    second = b.train_step(samples[1:], proximal_logprobs=proximal[1:])
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(second["ratio_mean"] - 1.0) > 1e-4  # the second step sees the first step's update
    params_a, params_b = _params(a), _params(b)
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k], rtol=1e-4, atol=1e-6)
    tokens = first["tokens"] + second["tokens"]
    assert stats["tokens"] == tokens
    assert stats["loss"] == pytest.approx((first["loss"] * first["tokens"] + second["loss"] * second["tokens"])
                                          / tokens, rel=1e-4)
    with pytest.raises(TrainerInputError, match="minibatches"):
        a.train_batch(samples, minibatches=4)


def _with_mask(sample: TrainSample, mask: list[bool] | None) -> TrainSample:
    return TrainSample(sample.prompt_ids, sample.images, sample.output_ids, sample.behaviour_logprobs,
                       sample.advantage, loss_mask=mask)


def test_loss_mask_leaves_masked_tokens_out_of_loss_and_token_count(model_dir, samples):
    def step(batch):
        trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
        return trainer.train_step(batch), _params(trainer)

    stats_none, params_none = step(samples)
    stats_all, params_all = step([_with_mask(s, [True] * len(s.output_ids)) for s in samples])
    assert stats_all["loss"] == pytest.approx(stats_none["loss"], rel=1e-6)
    for k in params_none:
        torch.testing.assert_close(params_all[k], params_none[k])
    # a sample whose tokens are all masked adds nothing: the step equals the step without it
    # (compared by gradient: Adam's first step turns rounding noise in a near-zero gradient into a full lr step)
    def gradient(batch):
        trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
        sums, _, _ = trainer.compute_gradients(batch)
        return sums["loss"], _gradients(trainer)

    stats_rest, _ = step(samples[1:])
    stats_drop, _ = step([_with_mask(samples[0], [False] * len(samples[0].output_ids)), *samples[1:]])
    assert stats_drop["tokens"] == stats_rest["tokens"] == sum(len(s.output_ids) for s in samples[1:])
    loss_rest, grads_rest = gradient(samples[1:])
    loss_drop, grads_drop = gradient([_with_mask(samples[0], [False] * len(samples[0].output_ids)), *samples[1:]])
    assert loss_drop == pytest.approx(loss_rest, rel=1e-5)
    for k in grads_rest:
        torch.testing.assert_close(grads_drop[k], grads_rest[k], rtol=1e-5, atol=1e-6)
    # a partly masked sample counts only its kept tokens
    half = [i % 2 == 0 for i in range(len(samples[0].output_ids))]
    stats_half, _ = step([_with_mask(samples[0], half)])
    assert stats_half["tokens"] == sum(half)


def test_a_batch_with_every_token_masked_takes_a_harmless_step(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    stats = trainer.train_step([_with_mask(s, [False] * len(s.output_ids)) for s in samples])
    assert stats["tokens"] == 0 and stats["loss"] == 0 and math.isfinite(stats["grad_norm"])


def test_a_loss_mask_of_the_wrong_length_is_rejected(model_dir, samples):
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-3))
    with pytest.raises(TrainerInputError, match="loss mask"):
        trainer.train_step([_with_mask(samples[0], [True])])


def test_unusable_samples_are_dropped_and_the_rest_trained(model_dir, samples):
    good = samples[:2]
    nan = TrainSample(good[0].prompt_ids, good[0].images, good[0].output_ids, good[0].behaviour_logprobs, math.nan)
    no_image = TrainSample(good[0].prompt_ids, [], good[0].output_ids, good[0].behaviour_logprobs, 1.0)  # pads, no image
    garbage = TrainSample(good[0].prompt_ids, [b"not a png"], good[0].output_ids, good[0].behaviour_logprobs, 1.0)
    reference = Trainer(model_dir, LearnerConfig(lr=1e-3)).train_step(good)
    stats = Trainer(model_dir, LearnerConfig(lr=1e-3)).train_step([nan, good[0], no_image, good[1], garbage])
    assert stats["dropped_samples"] == 3 and stats["samples"] == 2
    assert stats["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    with pytest.raises(TrainerInputError, match="no usable sample"):
        Trainer(model_dir, LearnerConfig(lr=1e-3)).train_step([nan, garbage])


def test_target_kl_measures_the_batch_update_and_moves_the_learning_rate(model_dir, samples, tmp_path):
    """learner.target_kl: after the batch the KL between the policy before and after its steps is reported (the
    k3 mean over the trained tokens, as a separate scoring computes it) and sets the next batch's learning rate:
    down by 1.5 when the update overshot the target, up to at most learner.lr when it fell short; the rate is
    saved and restored with the optimizer in the trainer's checkpoint."""
    for updates in (1, 2):
        trainer = Trainer(model_dir, LearnerConfig(lr=2e-3, target_kl=1e-6))
        before = trainer.compute_logprobs(samples)
        stats = trainer.train_batch(samples, minibatches=updates)
        assert stats["lr"] == 2e-3 and stats["optimizer_steps"] == updates
        assert stats["policy_kl"] == pytest.approx(batch_kl(before, trainer.compute_logprobs(samples)), rel=1e-6)
        assert stats["policy_kl"] > 2e-6
        assert trainer.lr == pytest.approx(2e-3 / 1.5)
    trainer.save_checkpoint(tmp_path / "ckpt")
    restored = Trainer(model_dir, LearnerConfig(lr=2e-3, target_kl=1e-6))
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.lr == pytest.approx(2e-3 / 1.5)
    patient = Trainer(model_dir, LearnerConfig(lr=2e-3, target_kl=1e3))
    patient.lr = 1e-3
    assert patient.train_batch(samples, minibatches=2)["lr"] == 1e-3
    assert patient.lr == pytest.approx(1.5e-3)  # the update fell short of the target: up, but not past lr
    assert "policy_kl" not in Trainer(model_dir, LearnerConfig(lr=2e-3)).train_batch(samples)


def test_max_kl_halves_an_update_that_moved_the_policy_too_far(model_dir, samples):
    """learner.max_kl: the batch's update is halved (parameters to the midpoint) until its KL is at most max_kl,
    so the policy kept is between the batch's start and the optimizer's step, and the KL reported is its own."""
    free = Trainer(model_dir, LearnerConfig(lr=2e-3, target_kl=1e3))
    start = _params(free)
    unbounded = free.train_batch(samples, minibatches=2)
    stepped = _params(free)
    bound = unbounded["policy_kl"] / 10
    trainer = Trainer(model_dir, LearnerConfig(lr=2e-3, target_kl=1e3, max_kl=bound))
    before = trainer.compute_logprobs(samples)
    stats = trainer.train_batch(samples, minibatches=2)
    assert unbounded["step_scale"] == 1.0 and stats["step_scale"] in {0.5 ** k for k in range(1, 7)}
    assert stats["policy_kl"] <= bound < unbounded["policy_kl"]
    assert stats["policy_kl"] == pytest.approx(batch_kl(before, trainer.compute_logprobs(samples)), rel=1e-6)
    scale = stats["step_scale"]
    for name, value in _params(trainer).items():
        torch.testing.assert_close(value, start[name] + scale * (stepped[name] - start[name]), rtol=1e-4,
                                   atol=1e-6, msg=name)

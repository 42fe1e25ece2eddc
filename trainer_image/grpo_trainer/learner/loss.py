"""The GRPO loss with the training step's scoring between the forward and the loss: `ScoredLoss`, a mixin of
`GRPOLearner`.

`compute_loss` is TRL's own, copied: `trl/experimental/async_grpo/async_grpo_trainer.py:1497-1625 (trl 1.16.0)`, which
offers no seam between the forward and the loss; the copy differs only where marked "step scoring". `_score_step`
asks grpo_trainer.learner.step_scoring for each sample's verdict and gathers them to rank 0, which takes the groups
left with no sample out of the progress accounting.
"""

from __future__ import annotations

import time

import torch
from trl.trainer.utils import nanmax, nanmin

from ..contract.codes import DropReason
from ..progress import SAMPLE_GROUP_KEY
from .step_scoring import masked_terms, score_step


class ScoredLoss:
    """TRL's `compute_loss` with the training step's scoring. Reads what `GRPOLearner` sets up: TRL's trainer
    state (`accelerator`, `epsilon_low`/`epsilon_high`, `_metrics`...), `importance_bounds`, `exclusions` and
    `progress`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's compute_loss with the training step's scoring between the forward and the loss.

        TRL's own: `trl/experimental/async_grpo/async_grpo_trainer.py:1497-1625 (trl 1.16.0)`, which offers no seam
        there; this copy differs only where marked "step scoring". A sample `score_step` takes out contributes no
        loss term and no gradient: its log-ratio is replaced before the exponential (a NaN there would turn the
        zero gradient of a masked term into NaN), and its terms are zeroed. The token normaliser is TRL's
        (`global_n_tokens`): masked terms count in it, as TRL GRPO's masked importance sampling keeps them.
        """
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        input_ids = inputs["input_ids"][mask_bool].unsqueeze(0)
        position_ids = inputs["position_ids"][mask_bool].unsqueeze(0)
        shift_labels = inputs["shift_labels"][mask_bool].unsqueeze(0)
        token_index = inputs["token_index"][selected]
        old_log_probs = inputs["old_log_probs"][selected]
        advantages = inputs["advantages"][selected]
        segment_id = inputs["segment_id"][selected]
        tree_kwargs = {
            key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        }
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()

        forward_start = time.time()
        # MoE models: request router logits so the forward returns the load-balancing loss
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(
            input_ids=input_ids,
            position_ids=position_ids,
            shift_labels=shift_labels,
            fused_lm_head=True,
            **router_kwargs,
            **tree_kwargs,
        )
        log_probs = outputs.log_probs.flatten()[token_index]
        entropy = outputs.entropy.flatten()[token_index]
        self._last_forward_time_s = time.time() - forward_start

        # step scoring: verdicts from the unmasked terms, then the loss over the kept ones only.
        kept = ~masked_terms(self._score_step(inputs, log_probs, old_log_probs, advantages, segment_id), segment_id)
        log_ratio = torch.where(kept, log_probs - old_log_probs, 0.0)
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = torch.where(kept, -torch.min(per_token_loss1, per_token_loss2), 0.0)  # step scoring

        # DDP/FSDP averages gradients across ranks (world_size).
        # To get correct per-token normalization we scale by 1/tokens_per_rank
        # = world_size / global_n_tokens, so after DDP averaging the effective
        loss = per_token_loss.sum()
        global_n_tokens = inputs["global_n_tokens"][0]
        world_size = self.accelerator.num_processes
        tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0)
        loss = loss / tokens_per_rank.to(torch.float32)
        # For DAPO, we would scale like this instead:
        # loss = loss / max(per_token_loss.size(0), 1)
        loss = loss / self.current_gradient_accumulation_steps

        # The policy loss above is scaled for gradient accumulation (HF auto-scaling is off here), so scale aux too
        if self.aux_loss_enabled:
            aux_loss = outputs.aux_loss
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps

        with torch.no_grad():
            local_ratio_sum = coef_1.sum()
            local_count = torch.full_like(local_ratio_sum, float(log_probs.numel()))
            # Approx KL: http://joschu.net/blog/kl-approx.html
            local_kl_sum = ((coef_1 - 1) - log_ratio).sum()
            local_entropy_sum = entropy.sum()

            # Compute the clipped probability ratios
            is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
            is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
            is_region_clipped = is_low_clipped | is_high_clipped
            local_low_clip_sum = is_low_clipped.float().sum()
            local_high_clip_sum = is_high_clipped.float().sum()
            local_region_clip_sum = is_region_clipped.float().sum()

            # Batch all-reduce: [ratio_sum, kl_sum, entropy_sum, low_clip_sum, high_clip_sum, region_clip_sum, count]
            stats = torch.stack(
                [
                    local_ratio_sum,
                    local_kl_sum,
                    local_entropy_sum,
                    local_low_clip_sum,
                    local_high_clip_sum,
                    local_region_clip_sum,
                    local_count,
                ]
            )
            stats = self.accelerator.reduce(stats, reduction="sum")
            (
                global_ratio_sum,
                global_kl_sum,
                global_entropy_sum,
                global_low_clip_sum,
                global_high_clip_sum,
                global_region_clip_sum,
                global_count,
            ) = stats.unbind(0)
            self._metrics["train"]["ratio"].append((global_ratio_sum / global_count).item())
            self._metrics["train"]["kl"].append((global_kl_sum / global_count).item())
            self._metrics["train"]["entropy"].append((global_entropy_sum / global_count).item())
            self._metrics["train"]["clip_ratio/low_mean"].append((global_low_clip_sum / global_count).item())
            self._metrics["train"]["clip_ratio/high_mean"].append((global_high_clip_sum / global_count).item())
            self._metrics["train"]["clip_ratio/region_mean"].append((global_region_clip_sum / global_count).item())

            num_seq = int(segment_id.max()) + 1  # completions in this rank's row

            def seg_sum(vals):  # per-completion segment sum over the flat selection
                return torch.zeros(num_seq, device=vals.device).index_add_(0, segment_id, vals)

            seq_tokens = seg_sum(torch.ones_like(coef_1, dtype=torch.float32))
            seq_low = seg_sum(is_low_clipped.float())
            seq_high = seg_sum(is_high_clipped.float())
            per_seq_low = seq_low / seq_tokens  # NaN for a completion with no valid tokens; ignored by nan-aware min
            per_seq_high = seq_high / seq_tokens
            gathered_low_min = self.accelerator.gather(nanmin(per_seq_low))
            gathered_high_max = self.accelerator.gather(nanmax(per_seq_high))
            self._metrics["train"]["clip_ratio/low_min"].append(nanmin(gathered_low_min).item())
            self._metrics["train"]["clip_ratio/high_max"].append(nanmax(gathered_high_max).item())

            if self.aux_loss_enabled:
                gathered_aux = self.accelerator.reduce(aux_loss.detach().to(torch.float32), reduction="sum")
                self._metrics["train"]["aux_loss"].append((gathered_aux / world_size).item())

        # Per-step accounting, accumulated across the micro-batches of one optimizer step and flushed in
        # `training_step`. The counts are batch-wide (the collator broadcasts one value per rank), so they are read off
        # rank-local inputs without a collective. Sample rewards and packing metrics are NOT gathered here — rank 0
        # already logged them in the collator.
        n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += n_forward_tokens
        self._step_trained_tokens += float(global_n_tokens)
        self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
        self._step_samples += n_forward_tokens / mean_seq_len
        self._step_forward_s += self._last_forward_time_s
        return loss

    def _score_step(self, inputs, log_probs, old_log_probs, advantages, segment_id):
        """This rank's verdicts (grpo_trainer.learner.step_scoring), gathered to rank 0, which excludes the groups left
        with no sample. One gather per micro-batch, on every rank alike (it is a collective)."""
        groups = inputs[SAMPLE_GROUP_KEY].reshape(-1)
        num_samples = int((groups >= 0).sum())
        with torch.no_grad():
            ratio = torch.exp(log_probs - old_log_probs)
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
            candidate = -torch.min(ratio * advantages, clipped * advantages)
        verdicts = score_step(log_probs.detach(), old_log_probs, candidate, segment_id, num_samples,
                              self.importance_bounds)
        row = torch.full_like(groups, -1)
        row[:num_samples] = verdicts
        gathered = self.accelerator.gather(torch.stack([groups, row], dim=1)).reshape(-1, 2)
        present = gathered[:, 1] >= 0
        masked = int((gathered[:, 1] > 0).sum())
        self._metrics["train"]["step_scoring/masked_frac"].append(masked / max(int(present.sum()), 1))
        if self.accelerator.is_main_process:
            decisions = self.exclusions.add(gathered[:, 0].tolist(), gathered[:, 1].tolist())
            for group_id in decisions.excluded:
                self.progress.exclude(group_id, DropReason.EXCLUDED)
            for group_id in decisions.readmitted:
                self.progress.readmit(group_id)
        return verdicts

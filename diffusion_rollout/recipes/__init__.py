"""The training recipes' machinery: everything a Flow-GRPO or DiffusionNFT run needs besides the
algorithm's few lines, tested here and run by the thin scripts in ``examples/``.

The recipes use the public client (``diffusion_rollout.client``) as any trainer would; this package
is what they have in common, by concern:

- the command line: :mod:`.options` (the shared options), :mod:`.config_file` (``--config``),
  :mod:`.flow_grpo_options`;
- where rollouts come from: :mod:`.servers` (``--url`` or a server started here), :mod:`.in_process`
  (``--layout in-process``), :mod:`.launch` (ranks, server, client around a run);
- the trainer: :mod:`.trainer` (device, dtype, its copy of the denoiser, the LoRA), :mod:`.full`
  (``--full-finetune``, FSDP2), :mod:`.ranks` (torchrun's ranks), :mod:`.reward` (``--reward-on``);
- the algorithms: :mod:`.flow_grpo` (the iteration), :mod:`.flow_grpo_rollouts`, :mod:`.policy_update`
  (replay and the clipped loss), :mod:`.diffusion_nft`;
- keeping the server honest: :mod:`.weight_sync` (push, verify, check), :mod:`.recovery` (a lost
  server waited for, re-pushed, the rollouts redone);
- what a run leaves: :mod:`.timing` (seconds per phase), :mod:`.records` (the JSON record, the
  summary, the curves), :mod:`.checkpoint` (``--checkpoint``), :mod:`.report` and :mod:`.run_logger`
  (progress lines, TensorBoard, W&B).

Nothing is imported here: ``import diffusion_rollout.recipes.ranks`` pulls in no model code.
"""

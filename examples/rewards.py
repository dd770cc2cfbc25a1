"""Rewards for the training recipes, as plug-ins.

A reward is any callable ``reward(images, prompts) -> torch.Tensor``:

- ``images``: ``uint8`` ``[N, 3, H, W]`` (images) or ``[N, 3, F, H, W]`` (videos), on the CPU, as the
  server returns them with ``output_dtype="uint8"`` (``round(x * 255)`` of the pipeline's [0, 1]
  output);
- ``prompts``: the ``N`` prompts, one per sample;
- returns ``[N]`` float32 rewards (higher is better).

The recipes take ``--reward SPEC``: a built-in name below, or ``package.module:callable`` /
``path/to/file.py:callable`` for your own (PickScore, HPS, OCR...). A spec that names a class or a
factory is called once with no arguments if the object it names is not itself a reward (so
``my_rewards:PickScore`` can load its model in ``__init__``); ``SPEC?key=value&...`` passes keyword
arguments to that call (``jpeg_compressibility?quality=80``).

Design decisions:

- **JPEG compressibility is DDPO's task**: minus the size in kB of the image saved as JPEG at a fixed
  quality (Pillow, quality 95 by default, no subsampling options beyond Pillow's defaults), the
  mean over frames for a video. It needs no model and no download, and a random-weight architecture
  can move it (smoother images compress better), which makes it the default.
- **The images arrive as bytes**, not floats: rewards are scored on exactly what a user would save,
  and the server's uint8 answer is a quarter of the float32 one.
- The rewards live in the package (``diffusion_rollout.rewards``) so that ``serve --reward`` can
  score them where the images are made; this module re-exports them for the recipes. In the
  trainer they run in the trainer's process on the CPU; the recipes time them as their own phase.
  The one exception is ``vlm_ocr_judge``, a generative VLM that reads the text in each image (verl-omni's
  OCR task): it runs on the rank's GPU and keeps ``last_seconds`` / ``tokens_generated`` of its last
  call for the recipe to report.
- **A spec is code.** Anything but a built-in name imports a module and calls what it names, in the
  trainer's process and as its user (``subprocess:Popen?args=...`` would run a command), from the
  command line or from ``--config``'s ``reward:`` alike. So only ``module:callable`` or
  ``file.py:callable`` spelled out is taken (a bare unknown name is an error, never a guess), and
  :func:`load_reward` logs once what it imported, from where, with which arguments.
"""

from diffusion_rollout.rewards import *  # noqa: F403 (the recipes' plug-in surface, one import away)
from diffusion_rollout.rewards import __all__  # noqa: F401

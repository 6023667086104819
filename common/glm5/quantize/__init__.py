"""`glm5 quantize`: float checkpoints to the quantized formats the loader (glm5.model.quant), vLLM and SGLang
read: block FP8 (GLM-5-FP8's format), compressed-tensors W4A16 and INT4 experts + FP8 elsewhere; which layers
by a recipe of module-name globs; INT4 by GPTQ over calibration prompts, or round-to-nearest without them."""

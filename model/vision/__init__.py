"""Image inputs of vision-language models: the vision encoders, their preprocessing and the
language model's multimodal rotary positions.

A vision-language checkpoint is a decoder family (`model.families`) whose config carries a
`VisionConfig` (`model.vision.config`) and whose `Weights.vision` holds the encoder's weights.
The encoder runs outside the decoder's step program (one call per image, its output cached by
image content in the serving layer); the step takes the encoder's output as the embeddings of
the image's placeholder tokens (`model.forward.forward(..., image_embeds=...)`).

Modules: `config` (the encoder's shape, hashable so it is jit-static), `qwen2_5_vl` (the windowed
ViT with 2-D rotary positions and the patch merger), `qwen2_5_vl_processor` (the checkpoint
processor's resize / rescale / normalize / patching in numpy and Pillow), `mrope` (the
temporal / height / width positions of a prompt holding images), `gemma3_siglip` (Gemma 3's SigLIP
encoder and its projector to soft tokens) and `gemma3_processor` (its fixed-size preprocessing).
"""

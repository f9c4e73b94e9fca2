"""gpt-oss (OpenAI's open-weight MoE, 20B and 120B): the MoE GPT with attention sinks, alternating
sliding-window and full layers, YaRN rotary scaling, biased projections and router, and biased experts
with a clamped SwiGLU (:mod:`.config`, :mod:`.model`), with its Hugging Face adapter (:mod:`.hf`)."""

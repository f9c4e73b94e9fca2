"""DeepSeek-V3 / V2 (``[model] kind = "deepseek-v3"``): multi-head latent attention, dense first layers,
sigmoid group-limited routing with shared experts."""

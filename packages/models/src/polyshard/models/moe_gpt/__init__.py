"""The GPT's mixture-of-experts variant (Mixtral, Qwen-MoE, DeepSeek-style routing): every block's MLP routed
experts (:mod:`.model`), with the Hugging Face adapters for Mixtral and Qwen-MoE (:mod:`.hf`)."""

"""LoRA adapters on the model's linear layers (adapters.py: loading and sharding; linear_method.py:
the products), on with --enable-lora."""

"""LoRA adapters served beside their base model: many adapters and the base in one batch."""

"""What the model is: its MoE layers, experts and top-k (``spec``), its config.json and expert shape, and the
offline Hugging Face lookup that finds them."""

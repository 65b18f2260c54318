"""What is read out of a model besides its logits: the activation cache (`activation_cache`), the
weights per head (`weights`), factored matrices (`factored`), the streaming head statistics of a
model or a KV cache (`head_statistics`) and the checks behind attention views (`attention_view`)."""

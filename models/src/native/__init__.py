"""interp's own transformer: the model (`transformer`), its attention layer (`attention_layer`), the
components a block is made of (`components`: norms, MLPs, embeddings, unembedding), mixture-of-experts
MLPs (`moe`) and TransformerLens's weight processing (`processing`)."""

"""RoPE chosen after training: a scaling chosen at load in place of a checkpoint's own (`choice`: its
spellings, checks and record), and a scaling or temperature on chosen heads only (`heads`)."""

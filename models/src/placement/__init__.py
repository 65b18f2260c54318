"""Where a model's weights live: the choice of where (`choice`: device, offload and device map as one
`Placement`, made and refused there), the device (`device`, the one door off it: `to_numpy`), device maps
(`device_map`), layer-by-layer offload (`offload`), memory estimates (`memory`) and the checkpoint
files the weights are mapped from (`tensor_files`)."""

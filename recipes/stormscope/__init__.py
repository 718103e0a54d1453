"""StormScope: a diffusion transformer with 2-D neighbourhood attention for km-scale nowcasting."""

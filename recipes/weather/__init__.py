"""Weather pieces shared by the recipes: the HRRR/ERA5 zarr dataset and its synthetic
generator, the regression and EDM diffusion tasks, EDM, metrics, plots and the loader of
trained stages. StormCast and StormScope build on these; the engine knows none of it."""

"""The latent-diffusion case study: a Stable-Diffusion-style text-to-image pipeline built from
scratchlm's layers (text encoder over scratchlm's BPE, AutoencoderKL VAE, PixArt-style DiT),
DDPM/DDIM/Euler schedulers, diffusers-format I/O, and CFG / component / patch parallelism.
See docs/diffusion.md."""

"""Speed against the base model: the bench stage, profiles and what is measured, the serving
client and load levels, speculative decoding. Engines are quantbench.engines. Independent of
quality/ and quantize/."""

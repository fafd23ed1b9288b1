"""The simulation and evaluation toolkit around the attack (not part of the attack).

Everything an experiment, a simulated client or a test needs to *produce* an update and to
*score* a reconstruction, and nothing the attack itself uses:

========================  =====================================================================
``testbed.data``          real images offline (photo crops, MNIST), torchvision datasets, batches
``testbed.photos``        the crop pools of real photographs behind ``testbed.data``
``testbed.views``         near-duplicates in a batch: augmented views of an image, repeats
``testbed.models``        the papers' ReLU MLPs; per-layer gradients and inputs of a batch
``testbed.cnn``           Flower's quickstart CNN, a wider CNN, the quickstart's training step
``testbed.simulate``      one client's local training: FedSGD, FedAvg, DP-SGD (``testbed.dpsgd``)
``testbed.dpsgd``         per-sample DP-SGD with Opacus: per-sample gradients or ghost clipping
``testbed.metrics``       PSNR / SSIM after optimal matching of reconstructions to originals
``testbed.tabular``       UCI Adult: loading, one-hot encoding, decoding and scoring
``testbed.baselines``     what a result is compared with: gradient matching, the batch mean
========================  =====================================================================

The attack (``fl_attack.invert``) takes tensors; it never imports this package.
"""

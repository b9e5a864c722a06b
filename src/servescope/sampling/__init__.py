"""servescope.sampling"""

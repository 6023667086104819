"""The kopf operator: GLM5Deployment and RLJob custom resources, their children, HCCL rank tables."""
